"""The step loop (schedule -> run -> postprocess) and the offline ``LLM`` API."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.attention import AttentionMetadata
from engine.cuda_graphs import RAGGED_MAX_TOKENS, RaggedGraphs, StepGraphs, use_cuda_graphs
from engine.model import AttentionSite, Qwen3Model, fused_linears
from engine.model_runner import ModelRunner, Row
from engine.parallel import OP_STOP, OP_SYNC, OP_TARGET
from engine.sampler import (LogitsBlock, LogitsState, accept_greedy, adjust_logits, probabilities, rejection_sample,
                            sample)
from engine.scheduler import ScheduledRequest, Scheduler
from engine.sequence import (Continuation, Request, RequestStatus, RequestTiming, SamplingParams, SpecStats,
                             TokenLogprob, generator_seed)
from engine.tokenizer import Tokenizer
from kv.device_tables import upload
from kv.layout import KVLayout
from kv.manager import KVCacheManager

log = logging.getLogger(__name__)

# The largest batch captured in a CUDA graph; larger decode batches run eagerly (launch overhead is then a
# small share of the step).
MAX_GRAPH_BATCH = 256


@dataclass
class Proposal:
    """Drafts for one decode row, on the device (they go into the verification forward and are compared there,
    never to the host), and the drafter's distributions over them when sampling (None: greedy)."""

    tokens: torch.Tensor                   # [K] int64
    probs: torch.Tensor | None = None      # [K, V]

    @property
    def num_drafts(self) -> int:
        return self.tokens.shape[0]


class Speculator(Protocol):
    """What the step loop needs from a drafter; a ``SpeculatorFactory`` (engine.llm) makes one per engine."""

    num_spec_tokens: int
    capture_layers: tuple[int, ...]

    def propose(self, rows: Sequence[ScheduledRequest]) -> list[Proposal]:
        """Drafts per row; a sampled row's carry the distributions they were drawn from (the step verifies every
        row itself: greedy by exact match, sampled by rejection sampling against those distributions)."""
        ...

    def store_context(self, items: Sequence[tuple[Request, int, torch.Tensor]]) -> None: ...

    def clear_context(self, request: Request) -> None: ...

    def enable_graphs(self, max_batch: int, max_pages: int, capture: bool, max_tokens: int | None
                      ) -> list[StepGraphs | RaggedGraphs]:
        """Run the drafter's full blocks through ``StepGraphs``, and its other forwards of up to ``max_tokens``
        tokens (None: none) through ``RaggedGraphs`` where it can (``LLMEngine.enable_cuda_graphs``)."""
        ...

    def attention_site(self) -> AttentionSite:
        """The drafter layers' attention (``LLMEngine.precompile_kernels``)."""
        ...

    def linear_weights(self) -> list[torch.Tensor]:
        """The weights (and weight views) the drafter's linears multiply by (``LLMEngine.precompile_kernels``)."""
        ...

    def fused_linears(self) -> list[tuple[torch.Tensor, dict]]:
        """The drafter's decoder layers' linears with the work a few-row step folds into them
        (``engine.model.fused_linears``)."""
        ...

    def can_draft_ahead(self, batch: int) -> bool:
        """Whether ``draft_ahead`` can run a batch of this many rows (overlap)."""
        ...

    def draft_ahead(self, requests: Sequence[Request], anchors: torch.Tensor, starts: torch.Tensor,
                    context: torch.Tensor, context_lens: torch.Tensor,
                    target_metadata: tuple[torch.Tensor, AttentionMetadata]
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Drafts ``[B, K]`` of ``requests`` for blocks whose anchors ``[B, 1]`` and starts ``[B]`` are on the device
        (a step launched from the previous one's results), chosen as ``propose`` chooses them, and the distributions
        the sampled rows' drafts were drawn from (``[S, K, V]``, sampled rows in order; None if there are none).
        First store each row's ``context_lens`` rows of ``context`` (the previous verification's captured hidden
        states, K + 1 rows a row) as the positions right before its block: the tokens the previous step gave the
        row, which its output does not count yet (a min_tokens mask adds them). ``target_metadata``: the verification's
        positions and metadata at the same rows, for a drafter whose layers share the target's pages."""
        ...

    # Tensor parallelism (ranks > 0 only): run a drafter forward rank 0 published.
    def follow(self, message, captured: torch.Tensor | None) -> None: ...


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int = 0
    spec: SpecStats = field(default_factory=SpecStats)
    new_token_ids: list[int] = field(default_factory=list)   # tokens added by the last step
    # The text that became final since the request's previous output: while unfinished it holds back the
    # last max(len(stop)) - 1 characters (a stop string may still begin there) and incomplete UTF-8; the
    # finishing output gives the rest up to the stop. A request's text_deltas concatenate to its text.
    text_delta: str = ""
    # With SamplingParams.logprobs: one entry per token of token_ids, and of new_token_ids (else None).
    logprobs: list[TokenLogprob] | None = None
    new_logprobs: list[TokenLogprob] | None = None
    timing: RequestTiming | None = None        # on the finishing output

    @property
    def acceptance_lengths(self) -> list[int]:
        return self.spec.acceptance_lengths

    @property
    def mean_acceptance_length(self) -> float | None:
        return self.spec.mean_acceptance_length


@dataclass
class _Choice:
    """A step's new tokens on the device (``LLMEngine._choose_tokens``): one flat int64 tensor, greedy plain rows'
    tokens first, then sampled plain rows', then per verification group its tokens and accept counts."""

    flat: torch.Tensor | None
    plain: dict[bool, list[int]]                  # greedy? -> scheduled indices without drafts
    spec: dict[tuple[int, bool], list[int]]       # (drafts, greedy?) -> scheduled indices
    num_rows: int

    @property
    def plain_order(self) -> list[int]:
        """The scheduled indices of the plain rows, in the order of their tokens in ``flat``."""
        return self.plain[True] + self.plain[False]

    def blocks(self, q: int, kept: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """On the device, for the scheduled rows ``kept`` (in that order) of a step whose rows all verified ``q - 1``
        drafts: their ``[len(kept), q]`` verified tokens and their ``[len(kept)]`` accept counts."""
        token_at, count_at, at = [0] * self.num_rows, [0] * self.num_rows, len(self.plain_order)
        for (k, _), group in self.spec.items():
            if k != q - 1:
                raise ValueError(f"a block of {k} drafts where every row should have {q - 1}")
            for n, i in enumerate(group):
                token_at[i], count_at[i] = at + n * q, at + len(group) * q + n
            at += len(group) * (q + 1)
        rows = len(kept)
        if list(kept) == [i for group in self.spec.values() for i in group] and len(self.spec) == 1:
            return self.flat[:rows * q].view(rows, q), self.flat[rows * q:rows * (q + 1)]    # one group, all kept
        index = upload([token_at[i] + j for i in kept for j in range(q)] + [count_at[i] for i in kept], torch.int64,
                       self.flat.device)
        picked = self.flat[index]
        return picked[:rows * q].view(rows, q), picked[rows * q:]

    def positions(self) -> list[list[int]]:
        """Per scheduled row, where its tokens are in ``flat`` (a verification row's K + 1, accepted or not; none for
        a row that chose no token)."""
        out: list[list[int]] = [[] for _ in range(self.num_rows)]
        for n, i in enumerate(self.plain_order):
            out[i] = [n]
        at = len(self.plain_order)
        for (k, _), group in self.spec.items():
            for n, i in enumerate(group):
                out[i] = list(range(at + n * (k + 1), at + (n + 1) * (k + 1)))
            at += len(group) * (k + 2)
        return out

    def rows(self, host: list[int]) -> list[list[int]]:
        """``flat`` read back on the host, as each scheduled row's new tokens."""
        out: list[list[int]] = [[] for _ in range(self.num_rows)]
        for n, i in enumerate(self.plain_order):
            out[i] = [host[n]]
        at = len(self.plain_order)
        for (k, _), group in self.spec.items():
            tokens, num_accepted = host[at:at + len(group) * (k + 1)], host[at + len(group) * (k + 1):]
            for n, i in enumerate(group):
                out[i] = tokens[n * (k + 1):n * (k + 1) + num_accepted[n] + 1]
            at += len(group) * (k + 2)
        return out


@dataclass
class _StepLogprobs:
    """The log-probabilities a step's rows asked for, computed on the device as the step is launched (from its raw
    logits, which the next step's graph may overwrite before the host reads them): per verified or decoded
    position, its chosen token's and the ``max(num_top)`` best tokens' (ids and values)."""

    first: dict[int, int]           # scheduled index -> its first position's row in the tensors
    num_top: dict[int, int]         # scheduled index -> how many alternatives it asked for
    tensors: list[torch.Tensor]     # chosen [R] float32, top values [R, K] float32, top ids [R, K] int64
    host: list[torch.Tensor] | None = None

    def entries(self, new_tokens: list[list[int]]) -> dict[int, list[TokenLogprob]]:
        """Per scheduled index that asked: its new tokens' entries (the host copies are complete)."""
        chosen, values, ids = (t.tolist() for t in (self.host or self.tensors))
        out = {}
        for i, first in self.first.items():
            n = self.num_top[i]
            out[i] = [TokenLogprob(token, chosen[first + k], tuple(zip(ids[first + k][:n], values[first + k][:n])))
                      for k, token in enumerate(new_tokens[i])]
        return out


@dataclass
class _Launched:
    """A step queued on the device (draft, forward, token choice) whose tokens the host has not read yet. ``_run``
    reads them at once; with overlap the host first launches the next step from them, still on the device."""

    scheduled: list[ScheduledRequest]
    rows: list[Row]                          # the target forward's rows (their token counts lay out ``captured``)
    slices: list[slice | None]               # each row's logit rows
    proposals: list[Proposal | None]
    choice: _Choice
    raw_logits: torch.Tensor
    captured: torch.Tensor | None            # the captured hidden states, row after row
    logprobs: _StepLogprobs | None = None    # the rows' log-probabilities, when any row asked for them
    host: torch.Tensor | None = None         # ``choice.flat`` copied to the host, complete once ``done`` has fired
    done: torch.cuda.Event | None = None

    def start_copy(self) -> "_Launched":
        """Queue the copy of the step's tokens (and log-probabilities) to the host; ``read`` waits for it."""
        flat = self.choice.flat
        if flat is not None and flat.device.type == "cuda":
            self.host = _pinned_copy(flat)
            if self.logprobs is not None:
                self.logprobs.host = [_pinned_copy(t) for t in self.logprobs.tensors]
            self.done = torch.cuda.Event()
            self.done.record()
        else:
            self.host = flat
        return self

    def read(self) -> list[int]:
        if self.host is None:            # not copied ahead: the synchronous path's one host read
            if self.logprobs is None or self.choice.flat.device.type != "cuda":
                return self.choice.flat.tolist() if self.choice.flat is not None else []
            self.start_copy()            # the tokens and the log-probabilities in one wait
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


OVERLAP_MODES = ("auto", "on", "off")


def use_overlap(mode: str, device: torch.device | str, tensor_parallel: bool) -> bool:
    """Whether an engine launches a decode step before reading the previous one's tokens: ``auto`` on CUDA with
    one rank, ``on`` wherever it can (it raises under tensor parallelism: ranks > 0 follow rank 0's steps one at a
    time), ``off`` never."""
    if mode not in OVERLAP_MODES:
        raise ValueError(f"overlap must be one of {OVERLAP_MODES}, got {mode!r}")
    if mode == "on" and tensor_parallel:
        raise ValueError("overlap=on but the engine is tensor-parallel (ranks > 0 run one step at a time)")
    if mode == "auto":
        return torch.device(device).type == "cuda" and not tensor_parallel
    return mode == "on"


class LLMEngine:
    """One engine instance: a scheduler, a model runner over a KV manager, an optional speculator."""

    def __init__(self, model: Qwen3Model, tokenizer: Tokenizer | None, kv: KVCacheManager, *, backend: str,
                 max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 speculator: Speculator | None = None, layout: KVLayout | None = None, cuda_graphs: str = "auto",
                 overlap: str = "auto"):
        self.model = model
        self.tokenizer = tokenizer
        self.kv = kv
        self.layout = layout
        self.speculator = speculator
        self.max_model_len = max_model_len
        self.runner = ModelRunner(model, kv, backend)
        for space in range(len(kv.pools)):
            # Room for every running request's longest table (held and transferring ones may grow it).
            kv.device_block_tables(space, model.device, rows=2 * max_num_seqs, pages=kv.pages_needed(max_model_len))
        self.scheduler = Scheduler(kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                   num_spec_tokens=speculator.num_spec_tokens if speculator else 0,
                                   max_model_len=max_model_len)
        eos = set(model.config.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.requests: dict[str, Request] = {}
        self.spec_stats = SpecStats()
        self._ids = itertools.count()
        # Seconds per step phase (draft, verify = target forward, bookkeeping); filled only when
        # ``time_phases`` is set, since timing a GPU step needs a device sync.
        self.time_phases = False
        self.phase_seconds: dict[str, float] = {"draft": 0.0, "target": 0.0, "bookkeeping": 0.0}
        self.max_num_seqs = max_num_seqs
        self.graphs: list[StepGraphs] = []
        # Overlap: a batch of decode rows (plain or speculative) launches its next step from the device's results
        # before the host reads them, so metadata, detokenization and outputs run while the device computes.
        self.overlap = use_overlap(overlap, model.device, model.tp is not None)
        self._launched: _Launched | None = None
        self._clock = self._phase_clock()
        self.num_overlapped_steps = 0      # steps launched before their predecessor's tokens were read
        self.num_prompt_steps = 0          # steps that computed prompt (or preempted history) tokens
        self.device_wait_s = 0.0           # the host waiting for steps' tokens (a spin-wait is on the core)
        if backend == "triton" and model.device.type == "cuda":
            self.precompile_kernels()
        if use_cuda_graphs(cuda_graphs, model.device, backend, model.tp is not None):
            self.enable_cuda_graphs(capture=True, ragged=cuda_graphs != "decode")

    def attention_sites(self) -> list[AttentionSite]:
        """The target's attention layers, then the drafter's."""
        sites = [AttentionSite(self.model.num_heads, self.runner.layer_kv[0], self.model.dtype, causal=True)]
        if self.speculator is not None:
            sites.append(self.speculator.attention_site())
        return sites

    def precompile_kernels(self) -> list[set[tuple]]:
        """Compile every Triton attention variant a step can take (``triton_attention.precompile``) and the few-row
        linears' tiles (``triton_ops.precompile_linears``), before the engine serves: one met later compiles inside
        a step and stalls every running request for a second or two. Per attention site, the variants launched.
        Triton keeps the binaries on disk, so a restart loads them."""
        from engine import triton_attention, triton_ops

        start = time.perf_counter()
        launched = [triton_attention.precompile(site.num_q_heads, site.kv.k_cache, site.kv.v_cache, site.query_dtype,
                                                causal=site.causal, max_seq_len=self.max_model_len,
                                                k_scale=site.kv.k_scale, v_scale=site.kv.v_scale)
                    for site in self.attention_sites()]
        linears = triton_ops.precompile_linears(self.linear_weights(), self.model.dtype, self.fused_linears())
        log.info("kernels ready: %d attention variants, %d linear variants in %.1f s", sum(map(len, launched)),
                 linears, time.perf_counter() - start)
        return launched

    def linear_weights(self) -> list[torch.Tensor]:
        """Every weight (or weight view) a step's linears multiply by: the target's, its LM head, the drafter's."""
        weights = [w for layer in self.model.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        weights.append(self.model.lm_head)
        if self.speculator is not None:
            weights += self.speculator.linear_weights()
        return weights

    def fused_linears(self) -> list[tuple[torch.Tensor, dict]]:
        """The target's and the drafter's linears with the work a few-row step folds into them
        (``engine.model.fused_linears``)."""
        return (fused_linears(self.model.layers, self.model.tp is not None)
                + (self.speculator.fused_linears() if self.speculator else []))

    def enable_cuda_graphs(self, capture: bool = True, ragged: bool = True) -> None:
        """Decode and verification steps (rows of 1 or K + 1 tokens) and the drafter's blocks through CUDA graphs
        at padded batch sizes up to ``max_num_seqs`` (at most ``MAX_GRAPH_BATCH``), and steps with a prefill chunk
        (and the drafter's context stores) of up to ``RAGGED_MAX_TOKENS`` through ragged graphs (``ragged``),
        captured now.
        ``capture=False`` runs the graphs' static, padded inputs eagerly instead: how tests pin the padding
        on a machine without a GPU."""
        spec = self.speculator
        max_batch = min(self.max_num_seqs, MAX_GRAPH_BATCH)
        max_tokens = min(self.scheduler.max_num_batched_tokens, RAGGED_MAX_TOKENS)
        pages = self.kv.pages_needed(self.max_model_len)
        query_lens = (1, spec.num_spec_tokens + 1) if spec else (1,)
        self.graphs = [self.runner.enable_graphs(query_lens, max_batch, pages, spec.capture_layers if spec else (),
                                                 capture)]
        if ragged:
            self.graphs.append(self.runner.enable_ragged_graphs(max_tokens, max_batch, pages, capture))
        if spec is not None:
            self.graphs += spec.enable_graphs(max_batch, pages, capture, max_tokens if ragged else None)
        if capture:
            for graphs in self.graphs:
                graphs.capture_all()

    # --- requests -------------------------------------------------------------------------------
    def _validate(self, request_id: str | None, prompt_token_ids: Sequence[int], params: SamplingParams
                  ) -> tuple[str, list[int]]:
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests or self.kv.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = list(prompt_token_ids)
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.model.config.vocab_size
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 or t >= vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        for name, tokens in (("stop_token_ids", params.stop_token_ids),
                             ("logit_bias", [t for t, _ in params.logit_bias])):
            if any(t >= vocab for t in tokens):
                raise ValueError(f"{name} must hold token ids in [0, {vocab}), got {max(tokens)}")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; the context holds {self.max_model_len} "
                             "(prompt plus at least one generated token)")
        pages = self.kv.pages_needed(min(len(ids) + params.max_tokens, self.max_model_len))
        capacity = min(pool.num_pages for pool in self.kv.pools)
        if pages > capacity:
            raise ValueError(f"the request needs {pages} KV pages (prompt {len(ids)} + max_tokens "
                             f"{params.max_tokens}); the pool has {capacity}")
        return request_id, ids

    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                    request_id: str | None = None, hold_pages: bool = False,
                    continuation: Continuation | None = None) -> Request:
        """Validate and queue a request; bad input raises ValueError and changes nothing.

        ``hold_pages``: keep the pages when the request finishes (a prefill whose KV a decode peer will
        read); ``release`` frees them.
        ``continuation``: the output the request already gave out on an engine that was lost; it goes on from there
        (``Continuation``), its first step computing the prompt and those tokens as a preempted request's does.
        """
        request_id, ids = self._validate(request_id, prompt_token_ids, params)
        if continuation is not None:
            self._check_continuation(ids, params, continuation)
        request = self._new_request(request_id, ids, params, hold_pages=hold_pages)
        if continuation is not None:
            self._continue(request, continuation)
        self.requests[request_id] = request
        self.scheduler.add(request)
        return request

    def _check_continuation(self, ids: list[int], params: SamplingParams, c: Continuation) -> None:
        tokens, vocab = c.output_token_ids, self.model.config.vocab_size
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in tokens):
            raise ValueError(f"continued output token ids must be integers in [0, {vocab})")
        if len(tokens) >= params.max_tokens:
            raise ValueError(f"the continued output has {len(tokens)} tokens; max_tokens {params.max_tokens} leaves "
                             "none to generate")
        if len(ids) + len(tokens) >= self.max_model_len:
            raise ValueError(f"the prompt and the continued output have {len(ids) + len(tokens)} tokens; the context "
                             f"holds {self.max_model_len} (and at least one more generated)")
        if params.logprobs is not None and (len(c.logprobs) != len(tokens) or any(
                e.token_id != t for e, t in zip(c.logprobs, tokens))):
            raise ValueError(f"logprobs={params.logprobs} needs the continued output's entries, one per token")
        if not isinstance(c.num_text_sent, int) or c.num_text_sent < 0:
            raise ValueError(f"the continued output's text sent must be an integer >= 0, got {c.num_text_sent!r}")

    def _continue(self, r: Request, c: Continuation) -> None:
        """Give the new request ``r`` the output ``c`` says was given out: tokens, their entries and counts, and
        their text (as much of it as its detokenizer would have given out; ValueError if less than was sent)."""
        r.output_token_ids.extend(c.output_token_ids)
        if r.params.logprobs is not None:
            r.output_logprobs.extend(c.logprobs)
        if self.tokenizer is not None:
            r.detokenizer = self.tokenizer.detokenizer(r.params.skip_special_tokens)
            # No stop honoured in it: the lost engine found none that ends there (else the request had ended).
            _extend_text(r, r.detokenizer.step(r.output_token_ids), honour_stops=False)
        if c.num_text_sent > len(r.output_text):
            raise ValueError(f"the continued output's text sent ({c.num_text_sent} characters) exceeds its text "
                             f"({len(r.output_text)})")
        r.num_text_sent = c.num_text_sent
        if r.logits_state is not None:
            r.logits_state.add(r.output_token_ids)

    def _new_request(self, request_id: str, ids: list[int], params: SamplingParams, **fields) -> Request:
        if params.seed is not None:
            # On the device: seeded draws need no host round trip (and repeat on one kind of device).
            fields["generator"] = torch.Generator(device=self.model.device).manual_seed(generator_seed(params.seed))
        request = Request(request_id, ids, params, **fields)
        request.logits_state = LogitsState.for_request(params, ids, self.model.config.vocab_size,
                                                       self.eos_token_ids, self.model.device)
        return request

    def reserve_transfer(self, prompt_token_ids: Sequence[int], first_token: int | None, params: SamplingParams,
                         request_id: str | None = None, first_logprob: TokenLogprob | None = None,
                         reuse_prefix: bool = True) -> Request | None:
        """Decode side of a disaggregated request: allocate pages for a prompt whose KV a peer computed.

        Returns None (changing nothing) when the pool lacks pages now. The request waits in TRANSFERRING,
        never scheduled and its pages never freed, until ``finish_transfer`` says its READ has ended.
        ``first_token``: the token the prefill sampled, or None when the pages are reserved before the prefill has
        ended (its ticket brings the token to ``finish_transfer``).
        ``first_logprob``: the first token's entry from the prefill's output, required when ``params.logprobs``
        is set (the outputs then list every token's, as an aggregated engine's do).
        ``reuse_prefix``: the prompt's leading full pages that this engine's prefix cache holds (drafter context
        included) are shared instead of allocated; ``num_reused_tokens`` says how many tokens they cover, and the
        READ must skip those pages (they are shared: nothing may write into them). Off for a request whose draft
        layers will be cleared (the ablation), which must own every page it clears.
        """
        request_id, ids = self._validate(request_id, prompt_token_ids, params)
        if first_token is not None:
            self.check_first_token(params, first_token, first_logprob)
        prefix = self.kv.probe_prefix(ids) if reuse_prefix else None
        if not self.kv.allocate_slots(request_id, len(ids) + 1, prefix):
            return None
        request = self._new_request(request_id, ids, params, status=RequestStatus.TRANSFERRING)
        request.num_reused_tokens = prefix.num_tokens if prefix is not None else 0
        if first_token is not None:
            request.output_token_ids.append(first_token)
            if params.logprobs is not None:
                request.output_logprobs.append(first_logprob)
        self.requests[request_id] = request
        return request

    def check_first_token(self, params: SamplingParams, first_token: int,
                          first_logprob: TokenLogprob | None = None) -> None:
        """ValueError unless ``first_token`` (and ``first_logprob``, when ``params.logprobs`` is set) can start a
        transferred request. Reads nothing that a step changes: safe off the engine thread."""
        if not 0 <= first_token < self.model.config.vocab_size:
            raise ValueError(f"first token {first_token} is outside the vocabulary")
        if params.logprobs is not None and (first_logprob is None or first_logprob.token_id != first_token):
            raise ValueError(f"logprobs={params.logprobs} needs first_logprob, the first token's entry from the "
                             f"prefill output (token {first_token}), got {first_logprob!r}")

    def finish_transfer(self, request_id: str, landed: bool, draft_context: bool = True,
                        first_token: int | None = None, first_logprob: TokenLogprob | None = None,
                        sampler_state: bytes | None = None) -> RequestOutput | None:
        """The READ into a TRANSFERRING request's pages has ended: start decoding it in the next step.

        ``landed=False`` (the READ failed) or an abort that came while the READ ran frees the pages now,
        and only now: a READ never writes into pages another request owns. Returns the first output (its
        ``finished`` is set when the first token already ends the request, or when it was dropped).
        ``draft_context=False``: the draft layers did not travel; they are zeroed, and the drafter starts
        from that empty context (the ablation).
        ``first_token`` (and ``first_logprob``): the prefill's first token, for a request reserved without it; a
        bad one (or none for such a request) frees the pages and raises ValueError.
        ``sampler_state``: a seeded request's generator as the prefill left it (``sampler_state``), so that its draws
        go on where the prefill's stopped, as in an engine that ran the whole request; one this engine's generator
        cannot take frees the pages and raises ValueError.
        """
        r = self.requests.get(request_id)
        if r is None or r.status != RequestStatus.TRANSFERRING:
            raise ValueError(f"request {request_id!r} is not awaiting a transfer")
        bad = None
        if landed and not r.abort_after_transfer:
            try:
                if (first_token is None) == (not r.output_token_ids):
                    raise ValueError(f"request {request_id!r} needs its first token exactly once, at its "
                                     "reservation or at the end of its transfer")
                if first_token is not None:
                    self.check_first_token(r.params, first_token, first_logprob)
                if sampler_state is not None and r.generator is not None:
                    _set_generator_state(r.generator, sampler_state)
            except ValueError as e:
                bad = e
        if not landed or r.abort_after_transfer or bad is not None:
            del self.requests[request_id]
            self.kv.free(request_id)
            r.status = RequestStatus.FINISHED
            r.finish_reason = "abort" if r.abort_after_transfer else "error"
            if bad is not None:
                raise bad
            return RequestOutput(r.request_id, r.prompt_token_ids, [], "", True, r.finish_reason)
        if first_token is not None:
            r.output_token_ids.append(first_token)
            if r.params.logprobs is not None:
                r.output_logprobs.append(first_logprob)
        r.num_computed_tokens = r.num_prompt_tokens
        r.num_draft_context = r.num_prompt_tokens
        if not draft_context and self.speculator is not None:
            self.speculator.clear_context(r)
            r.draft_context_valid = False
        r.status = RequestStatus.RUNNING
        r.first_scheduled_time = r.first_token_time = time.monotonic()
        self.scheduler.running.append(r)
        first = r.output_token_ids.pop()
        first_logprobs = [r.output_logprobs.pop()] if r.output_logprobs else None
        out = self._output(r, self._append(r, [first], first_logprobs))
        if r.finished:
            self._end_pages(r)
            self.requests.pop(request_id, None)
        else:
            self._commit(r)
        return out

    def release(self, request_id: str) -> None:
        """Free the held pages of a finished prefill request."""
        request = self.requests.get(request_id)
        if request is not None and not request.finished:
            raise ValueError(f"request {request_id!r} is still {request.status.value}; abort it instead")
        self.requests.pop(request_id, None)
        self.kv.free(request_id)

    def abort(self, request_id: str) -> None:
        """End a request wherever it is (queued, running, held) and free its pages.

        A request whose KV is being read keeps its pages until ``finish_transfer``: the READ may still write.
        """
        request = self.requests.get(request_id)
        if request is None:
            return
        if request.status == RequestStatus.TRANSFERRING:
            request.abort_after_transfer = True
            return
        del self.requests[request_id]
        request.hold_pages = False
        if not request.finished:
            self._finish(request, "abort")
        else:
            self.kv.free(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._launched is not None

    # --- tensor parallelism ---------------------------------------------------------------------
    def follow(self) -> None:
        """Ranks > 0: run every forward rank 0 publishes, in order, until it publishes stop. Their scheduler
        stays empty: block tables, tokens and drafts all arrive in the messages."""
        tp = self.model.tp
        captured = None
        while True:
            message = tp.receive()
            if message.op == OP_STOP:
                return
            if message.op == OP_SYNC:
                self._sync_device()
                tp.barrier()
            elif message.op == OP_TARGET:
                captured = self.runner.follow(message)
            else:
                self.speculator.follow(message, captured)

    def sync_ranks(self) -> None:
        """Rank 0: return once every rank has run every forward published so far and its device has finished
        their writes, because another process is about to read or write their pages (a disaggregated transfer).
        Ranks > 0 lag behind rank 0 between collectives (a drafter context store has none), and a GPU runs
        the kernels of a step after the host has moved on: the drafter's context store, launched after the
        step's tokens came back, may still be writing a page that a READ is about to copy (prefill) or that
        was freed and is about to be overwritten by one (decode)."""
        if self.model.tp is not None:
            self.model.tp.publish(OP_SYNC)
        self._sync_device()
        if self.model.tp is not None:
            self.model.tp.barrier()

    def pages_settled(self) -> torch.cuda.Event | None:
        """Rank 0, before another process writes into pages this engine has just handed to a request (a decode
        READ): None once nothing this engine launched can still write into them, else an event that completes
        when the device has run everything launched so far (a step launched ahead may still write into pages that
        a request finished on the host has freed). Waiting for it is the caller's: the engine thread goes on
        stepping. With tensor parallelism it returns None after ``sync_ranks`` (ranks > 0 give no event)."""
        if self.model.tp is not None:
            self.sync_ranks()
            return None
        if self.model.device.type != "cuda":
            return None
        event = torch.cuda.Event(blocking=True)     # its waiter sleeps
        event.record(torch.cuda.current_stream(self.model.device))
        return event

    def _sync_device(self) -> None:
        if self.model.device.type == "cuda":
            torch.cuda.current_stream(self.model.device).synchronize()

    def stop_followers(self) -> None:
        """Rank 0: release ranks > 0 from ``follow`` (call when no step runs any more)."""
        if self.model.tp is not None:
            self.model.tp.publish(OP_STOP)

    def _finish(self, request: Request, reason: str, ending: bool = False) -> None:
        """``ending``: it ended normally in the step being concluded, whose drafter context store may still write its
        pages: they stay with it until ``_end_pages``, which offers the full ones to the prefix cache first."""
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.logits_state = None         # its [V] tensors are not needed any more
        request.ending = ending and not request.hold_pages
        self.scheduler.remove(request, free_pages=not (request.hold_pages or request.ending))

    def _end_pages(self, request: Request) -> None:
        """A request that ended in the step just concluded: its full pages (their drafter context stored by now, or
        by a step launched ahead before anything later runs) go to the prefix cache, the rest back to the pool. A
        request that ends in its prompt step (``max_tokens`` 1) leaves its prompt for the next one that begins
        alike, as the last pages of every answer do for a conversation's next turn."""
        if request.ending:
            request.ending = False
            self._commit(request)
            self.kv.free(request.request_id)

    # --- the step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step; returns an output for every request that made progress or finished.

        With overlap, a batch of decode rows (plain, or speculative with full draft blocks; greedy or sampled, with
        penalties, a bias, a min_tokens mask or logprobs too) runs one step ahead of the host: while the batch is
        unchanged the step launches the next draft and forward from the device's tokens (and accept counts), then
        reads and processes the previous step's. A request that a token read then ends (EOS, a stop) had one more
        step computed for it, whose tokens are dropped and whose K/V lands past its end, in its own pages (never a
        full, shareable one; the pages go back at once, and what reuses them is queued behind it). A request that
        ended leaves the batch ahead; a batch that would change otherwise (a request waiting or joining, one near
        the context limit, every row ending) is read first and scheduled as usual."""
        launched = self._launched
        if launched is None:
            plan = self.scheduler.schedule()
            if not plan.scheduled:
                return []
            if not all(s.is_decode for s in plan.scheduled):
                self.num_prompt_steps += 1
            if not self._overlappable(plan.scheduled):
                return self._guarded(plan.scheduled, lambda: self._run(plan.scheduled))
            launched = self._guarded(plan.scheduled, lambda: self._forward(plan.scheduled).start_copy())
        self._launched = None
        ahead = self._guarded(launched.scheduled, lambda: self._launch_ahead(launched))
        self._launched = ahead
        return self._guarded(launched.scheduled + (ahead.scheduled if ahead else []),
                             lambda: self._conclude(launched, ahead))

    def _guarded(self, scheduled: Sequence[ScheduledRequest], fn):
        """``fn()``; when it raises, the requests of ``scheduled`` fail (their pages go back) before the error
        propagates, and no launched step is left to read."""
        try:
            return fn()
        except Exception:
            self._launched = None
            for item in scheduled:
                if item.request.ending:         # ended before the failure: its pages go back, none cached
                    item.request.ending = False
                    self.kv.free(item.request.request_id)
                if not item.request.finished:
                    self._finish(item.request, "error")
            raise

    def _overlappable(self, scheduled: list[ScheduledRequest]) -> bool:
        if not self.overlap or self.time_phases:
            return False
        spec = self.speculator
        if spec is not None and not (spec.can_draft_ahead(len(scheduled)) and self.runner.graphs is not None
                                     and self.runner.graphs.accepts(len(scheduled), spec.num_spec_tokens + 1)):
            return False
        drafts = spec.num_spec_tokens if spec is not None else 0
        return all(s.is_decode and s.num_spec_tokens == drafts for s in scheduled)

    def _launch_ahead(self, launched: _Launched) -> _Launched | None:
        """The step after ``launched``, launched from its device results, for its rows still running (a finished or
        aborted request leaves the batch), when nothing else changes: nobody waiting, no other request running,
        none near the context limit, not every row ending by max_tokens, a KV slot for every position the next step
        may compute."""
        kept = [i for i, item in enumerate(launched.scheduled) if item.request.status == RequestStatus.RUNNING]
        if not kept or self.scheduler.waiting or len(self.scheduler.running) != len(kept):
            return None
        rows = [launched.scheduled[i].request for i in kept]
        step = self.speculator.num_spec_tokens + 1 if self.speculator is not None else 1   # tokens a row may gain
        if any(r.num_computed_tokens + 2 * step >= self.max_model_len for r in rows):
            return None
        # A row that ``launched`` may end by max_tokens goes along (its next tokens are dropped if it did: a row's
        # work, where a synchronous step would expose the host's for the whole batch), unless every row surely ends.
        if all(len(r.output_token_ids) + 1 >= r.params.max_tokens for r in rows):
            return None
        # Slots for the next step's history token (the lookahead covers its drafts); an allocation that fails
        # leaves the pages it did get with their requests, for the scheduler's next step.
        if not all(self.kv.allocate_slots(r.request_id, r.num_computed_tokens + step + 1) for r in rows):
            return None
        self.num_overlapped_steps += 1
        if self.speculator is None:
            return self._plain_ahead(launched, kept).start_copy()
        return self._speculate_ahead(launched, kept).start_copy()

    def _plain_ahead(self, launched: _Launched, kept: list[int]) -> _Launched:
        """A decode step one position past each kept row's computed history, its ids the launched step's tokens:
        rows in the order of those tokens (greedy rows, then sampled)."""
        choice = launched.choice
        keep = set(kept)
        at = [n for n, i in enumerate(choice.plain_order) if i in keep]       # the kept rows' tokens in ``flat``
        ids = choice.flat if len(at) == len(choice.plain_order) else choice.flat[upload(at, torch.int64,
                                                                                          choice.flat.device)]
        scheduled = [ScheduledRequest(launched.scheduled[i].request, 1) for i in choice.plain_order if i in keep]
        rows = [Row(s.request.request_id, s.request.num_computed_tokens + 1, 1) for s in scheduled]
        for n, item in enumerate(scheduled):        # penalised rows: the launched token counts from now on
            if item.request.logits_state is not None:
                item.request.logits_state.count_ahead(ids[n:n + 1], ids.new_ones(1))
        raw_logits, _ = self.runner.run(rows, ids, range(len(rows)))
        slices = [slice(i, i + 1) for i in range(len(rows))]
        proposals = [None] * len(rows)
        logits = self._adjusted_ahead(raw_logits, scheduled, slices, proposals, None)
        return self._launched_step(scheduled, rows, slices, proposals,
                                   self._choose_tokens(scheduled, slices, proposals, logits), raw_logits, None)

    @staticmethod
    def _adjusted_ahead(raw_logits: torch.Tensor, scheduled: list[ScheduledRequest], slices: list[slice],
                        proposals: list[Proposal | None], emitted: torch.Tensor | None) -> torch.Tensor:
        """A step launched ahead's logits with its rows' bias, min_tokens mask and penalties applied, as
        ``_forward`` applies them: their counts include the launched step's tokens (``LogitsState.count_ahead``),
        and their output lengths the ``emitted`` ``[n]`` tokens the launched step gave each row, on the device
        (None: one each, a plain step's, which the host knows)."""
        blocks = [LogitsBlock(item.request.logits_state, slices[i].start, slices[i].stop - slices[i].start,
                              len(item.request.output_token_ids) + (emitted is None),
                              proposals[i].tokens if proposals[i] is not None else None,
                              None if emitted is None else emitted[i])
                  for i, item in enumerate(scheduled) if item.request.logits_state is not None]
        return adjust_logits(raw_logits, blocks) if blocks else raw_logits

    @torch.inference_mode()
    def _speculate_ahead(self, launched: _Launched, kept: list[int]) -> _Launched:
        """A speculative step from the launched one's device results, for its kept rows: each row's block starts
        one past its accepted tokens, anchored at its bonus token; the drafter graph stores the accepted positions'
        context first, then drafts (greedy rows their argmax, sampled rows a draw); the target verifies; greedy rows
        are accepted by exact match and sampled rows by rejection sampling, on the device, as ``_choose_tokens``
        does. The host sends only each row's computed history length (the launched step's start) and block table
        row."""
        spec = self.speculator
        q = spec.num_spec_tokens + 1
        tokens, num_accepted = launched.choice.blocks(q, kept)
        emitted = None
        for n, i in enumerate(kept):        # penalised rows: the launched step's emitted tokens count from now on
            state = launched.scheduled[i].request.logits_state
            if state is not None:
                if emitted is None:
                    emitted = torch.arange(q, device=tokens.device)[None, :] <= num_accepted[:, None]
                state.count_ahead(tokens[n], emitted[n])
        captured = launched.captured
        if len(kept) < len(launched.scheduled):
            index = upload(kept, torch.int64, captured.device)
            captured = captured.reshape(len(launched.scheduled), q, -1)[index].flatten(0, 1)
        scheduled = [ScheduledRequest(launched.scheduled[i].request, 1, q - 1) for i in kept]
        requests = [s.request for s in scheduled]
        n = len(scheduled)
        request_ids = [r.request_id for r in requests]
        starts = upload([r.num_computed_tokens for r in requests], torch.int64, tokens.device) + num_accepted + 1
        anchors = tokens.gather(1, num_accepted[:, None])
        positions, meta = self.runner.metadata_ahead(request_ids, starts, q)
        emitted = num_accepted + 1          # the launched step's tokens a row: the host has not counted them yet
        drafts, probs = spec.draft_ahead(requests, anchors, starts, captured, emitted, (positions, meta))
        raw_logits, captured = self.runner.run_ahead(q, torch.cat([anchors, drafts], 1).flatten(), positions, meta,
                                                     spec.capture_layers)
        slices = [slice(i * q, (i + 1) * q) for i in range(n)]
        proposals = [Proposal(d) for d in drafts]
        logits = self._adjusted_ahead(raw_logits, scheduled, slices, proposals, emitted)
        greedy = [i for i, r in enumerate(requests) if r.params.greedy]
        sampled = [i for i, r in enumerate(requests) if not r.params.greedy]
        groups: dict[tuple[int, bool], list[int]] = {}
        pieces: list[torch.Tensor] = []
        if greedy:
            groups[(q - 1, True)] = greedy
            best = logits.argmax(-1).view(n, q)
            rows = None if len(greedy) == n else upload(greedy, torch.int64, logits.device)
            new_tokens, accepted = accept_greedy(drafts if rows is None else drafts[rows],
                                                 best if rows is None else best[rows])
            pieces += [new_tokens.flatten(), accepted]
        if sampled:
            groups[(q - 1, False)] = sampled
            rows = upload(sampled, torch.int64, logits.device)
            p = probabilities(logits.view(n, q, -1)[rows].flatten(0, 1),
                              [requests[i].params for i in sampled for _ in range(q)]).view(len(sampled), q, -1)
            new_tokens, accepted = rejection_sample(drafts[rows], probs, p, [requests[i].generator for i in sampled])
            pieces += [new_tokens.flatten(), accepted]
        choice = _Choice(torch.cat(pieces), {True: [], False: []}, groups, n)
        return self._launched_step(scheduled, [Row(rid, -1, q) for rid in request_ids], slices, proposals, choice,
                                   raw_logits, captured)

    def _settle(self, outputs: list[RequestOutput]) -> None:
        """After a step's outputs: finished requests leave, unless they hold their pages; those and the running ones
        offer their full pages to the prefix cache. A held request is a prefill that a decode peer will READ, which
        ends in the step that computes the last of its prompt: its prompt's pages (their drafter context stored by
        now) serve the next prompt that begins alike, a repeated system prompt or the next turn of a chat."""
        for out in outputs:
            request = self.requests[out.request_id]
            if request.finished and not request.hold_pages:
                self._end_pages(request)
                del self.requests[out.request_id]
            else:
                self._commit(request)

    def _choose_tokens(self, scheduled: list[ScheduledRequest], slices: list[slice | None],
                       proposals: list[Proposal | None], logits: torch.Tensor) -> "_Choice":
        """Every row's new tokens, decided on the device into one flat tensor that reaches the host in one
        transfer for the whole step (the step's one host sync): greedy plain rows from one argmax of all logit
        rows, sampled plain rows in one batched draw, speculative rows verified in one batch per draft count and
        kind (greedy: exact match against that argmax; sampled: rejection sampling)."""
        device = logits.device
        plain: dict[bool, list[int]] = {True: [], False: []}             # greedy? -> rows without drafts
        spec: dict[tuple[int, bool], list[int]] = {}                      # (drafts, greedy?) -> rows
        for i, item in enumerate(scheduled):
            if slices[i] is None:
                continue
            greedy = item.request.params.greedy
            if proposals[i] is not None and proposals[i].num_drafts:
                spec.setdefault((proposals[i].num_drafts, greedy), []).append(i)
            else:
                plain[greedy].append(i)
        best = logits.argmax(-1) if plain[True] or any(greedy for _, greedy in spec) else None
        pieces: list[torch.Tensor] = []      # int64 tensors on the device, all fetched at once
        if plain[True]:
            every = [slices[i].start for i in plain[True]] == list(range(len(logits)))
            pieces.append(best if every else best[upload([slices[i].start for i in plain[True]], torch.int64,
                                                         device)])
        if plain[False]:
            pieces.append(sample(logits[upload([slices[i].start for i in plain[False]], torch.int64, device)],
                                 [scheduled[i].request.params for i in plain[False]],
                                 [scheduled[i].request.generator for i in plain[False]]))
        for (k, greedy), group in spec.items():
            index = upload([j for i in group for j in range(slices[i].start, slices[i].stop)], torch.int64, device)
            drafts = torch.stack([proposals[i].tokens for i in group])
            if greedy:
                tokens, num_accepted = accept_greedy(drafts, best[index].view(len(group), k + 1))
            else:
                params = [scheduled[i].request.params for i in group for _ in range(k + 1)]
                p = probabilities(logits[index], params).view(len(group), k + 1, -1)
                q = torch.stack([proposals[i].probs for i in group])
                tokens, num_accepted = rejection_sample(drafts, q, p, [scheduled[i].request.generator for i in group])
            pieces += [tokens.flatten(), num_accepted]
        flat = (pieces[0] if len(pieces) == 1 else torch.cat(pieces)) if pieces else None
        return _Choice(flat, plain, spec, len(scheduled))

    def _run(self, scheduled: list[ScheduledRequest]) -> list[RequestOutput]:
        return self._conclude(self._forward(scheduled), None)

    def _forward(self, scheduled: list[ScheduledRequest]) -> _Launched:
        """Draft, run the target and choose the tokens of ``scheduled`` on the device; nothing waits for it."""
        spec = self.speculator
        self._clock = clock = self._phase_clock()
        proposals = iter(spec.propose([s for s in scheduled if s.num_spec_tokens]) if spec else ())
        clock("draft")
        rows, token_ids, logit_rows, row_proposals, slices = [], [], [], [], []
        draft_at: list[int] = []        # where the drafts go in the flat ids (they stay on the device)
        for item in scheduled:
            r = item.request
            history = r.history[r.num_computed_tokens:r.num_computed_tokens + item.num_new_tokens]
            proposal = next(proposals) if item.num_spec_tokens else None
            num_drafts = proposal.num_drafts if proposal else 0
            rows.append(Row(r.request_id, r.num_computed_tokens, len(history) + num_drafts))
            if item.completes_history:
                # Logits of the last history token and of every draft: len(drafts) + 1 verification targets.
                last = len(token_ids) + len(history) - 1
                slices.append(slice(len(logit_rows), len(logit_rows) + num_drafts + 1))
                logit_rows.extend(range(last, last + num_drafts + 1))
            else:
                slices.append(None)
            draft_at.extend(range(len(token_ids) + len(history), len(token_ids) + len(history) + num_drafts))
            token_ids.extend(history + [0] * num_drafts)
            row_proposals.append(proposal)
        ids = upload(token_ids, torch.int64, self.model.device)
        if draft_at:
            ids.index_copy_(0, upload(draft_at, torch.int64, ids.device),
                            torch.cat([p.tokens for p in row_proposals if p is not None]))
        raw_logits, captured = self.runner.run(rows, ids, logit_rows, spec.capture_layers if spec else ())
        clock("target")
        # Penalties, bias and the min_tokens mask shape the distribution that sampling and verification use;
        # verify row k counts the k drafts before it, so speculation keeps the penalised target's output.
        blocks = [LogitsBlock(item.request.logits_state, slices[i].start, slices[i].stop - slices[i].start,
                              len(item.request.output_token_ids), row_proposals[i].tokens if row_proposals[i] else None)
                  for i, item in enumerate(scheduled) if slices[i] is not None and item.request.logits_state]
        logits = adjust_logits(raw_logits, blocks) if blocks else raw_logits
        choice = self._choose_tokens(scheduled, slices, row_proposals, logits)
        return self._launched_step(scheduled, rows, slices, row_proposals, choice, raw_logits, captured)

    def _conclude(self, step: _Launched, ahead: _Launched | None) -> list[RequestOutput]:
        """Read a step's tokens (the step's one host sync) and append them; a row whose request ended since the
        step was launched (an abort, or the step before it ended it) is dropped. Rows that ``ahead`` continues
        had their accepted context stored by its drafter graph; the others' goes to the speculator."""
        spec, scheduled, rows = self.speculator, step.scheduled, step.rows
        clock = self._clock if ahead is None and step.host is None else (lambda phase: None)
        began = time.perf_counter()
        new_tokens = step.choice.rows(step.read())
        self.device_wait_s += time.perf_counter() - began
        live = [item.request.status == RequestStatus.RUNNING for item in scheduled]
        for i, proposal in enumerate(step.proposals):
            if proposal is not None and live[i]:
                accepted = len(new_tokens[i]) - 1
                scheduled[i].request.spec.record(proposal.num_drafts, accepted)
                self.spec_stats.record(proposal.num_drafts, accepted)
        logprobs = step.logprobs.entries(new_tokens) if step.logprobs is not None else {}
        continued = {item.request.request_id for item in ahead.scheduled} if ahead is not None else set()
        outputs, context_items, offset = [], [], 0
        for i, item in enumerate(scheduled):
            r = item.request
            first, offset = offset, offset + rows[i].num_tokens       # the row's first captured row
            if not live[i]:
                continue
            start = r.num_computed_tokens
            # Positions whose K/V stay valid: the history computed now plus the accepted drafts; the
            # rest of the verified block is rolled back by not counting it.
            computed = item.num_new_tokens + max(0, len(new_tokens[i]) - 1)
            if r.request_id in continued and item.num_spec_tokens:
                r.num_draft_context = start + computed        # the next step's drafter graph stores it
            elif step.captured is not None:
                context_items.append((r, start, step.captured[first:first + computed]))
            r.num_computed_tokens = start + computed
            if r.first_token_time is None and new_tokens[i]:
                r.first_token_time = time.monotonic()
            outputs.append(self._output(r, self._append(r, new_tokens[i], logprobs.get(i))))
        clock("bookkeeping")
        if context_items:
            spec.store_context(context_items)
        clock("draft")
        self._settle(outputs)
        clock("bookkeeping")
        return outputs

    @staticmethod
    def _launched_step(scheduled: list[ScheduledRequest], rows: list[Row], slices: list[slice | None],
                       proposals: list[Proposal | None], choice: _Choice, raw_logits: torch.Tensor,
                       captured: torch.Tensor | None) -> _Launched:
        """The launched step, with the log-probabilities its rows asked for computed now, on the device, from the
        target's raw logits (a verified token k's from verify row k, as target-only decoding would give it; vLLM's
        default), all rows in one batch: they reach the host with the tokens, and a step launched ahead may
        overwrite the logits before then."""
        want = [i for i, item in enumerate(scheduled)
                if slices[i] is not None and item.request.params.logprobs is not None]
        logprobs = None
        if want:
            positions = choice.positions()
            first, num_top, logit_rows, token_at = {}, {}, [], []
            for i in want:
                first[i], num_top[i] = len(logit_rows), scheduled[i].request.params.logprobs
                logit_rows += range(slices[i].start, slices[i].start + len(positions[i]))
                token_at += positions[i]
            device = raw_logits.device
            lp = raw_logits.index_select(0, upload(logit_rows, torch.int64, device)).float().log_softmax(-1)
            chosen = lp.gather(1, choice.flat[upload(token_at, torch.int64, device)][:, None]).squeeze(1)
            values, ids = lp.topk(max(num_top.values()), dim=-1)
            logprobs = _StepLogprobs(first, num_top, [chosen, values, ids])
        return _Launched(scheduled, rows, slices, proposals, choice, raw_logits, captured, logprobs)

    def _phase_clock(self):
        """A function that charges the time since its last call to a phase (a no-op unless timing)."""
        if not self.time_phases:
            return lambda phase: None
        sync = torch.cuda.synchronize if self.model.device.type == "cuda" else (lambda: None)
        last = [time.perf_counter()]

        def charge(phase: str) -> None:
            sync()
            now = time.perf_counter()
            self.phase_seconds[phase] += now - last[0]
            last[0] = now
        return charge

    def _commit(self, r: Request) -> None:
        """Offer the request's full pages to the prefix cache; draft parts count only where valid."""
        draft = None
        if self.speculator is not None:
            draft = r.num_draft_context if r.draft_context_valid else 0
        self.kv.commit(r.request_id, r.history, r.num_computed_tokens, draft)

    def _append(self, r: Request, new_tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> list[int]:
        """Append tokens (and their ``logprobs`` entries) until a stop condition; finish the request when one is met.

        With a tokenizer, each token's text is detokenized incrementally onto ``r.output_text`` and stop
        strings are looked for only where one could end in that new text; a stop cuts the text where it
        begins (or ends, with include_stop_str_in_output). When the request ends otherwise, the text still held
        back (incomplete UTF-8) is added too. Before min_tokens output tokens no stop is honoured.
        """
        detok = None
        if self.tokenizer is not None:
            if r.detokenizer is None:
                r.detokenizer = self.tokenizer.detokenizer(r.params.skip_special_tokens)
            detok = r.detokenizer
        if detok is not None and not r.params.stop:
            appended = self._append_without_stops(r, detok, new_tokens, logprobs)
            new_tokens = ()
        else:
            appended = []
        for k, token in enumerate(new_tokens):
            r.output_token_ids.append(token)
            if logprobs is not None:
                r.output_logprobs.append(logprobs[k])
            appended.append(token)
            stops = len(r.output_token_ids) >= r.params.min_tokens
            if detok is not None and _extend_text(r, detok.step(r.output_token_ids), stops):
                reason = "stop"                                  # a stop string: the text is cut at it
            else:
                reason = self._limit_reason(r, token)
                if reason and detok is not None and _extend_text(r, detok.finish(r.output_token_ids), stops):
                    reason = "stop"                              # a stop string in the held-back text
            if reason:
                self._finish(r, reason, ending=True)
                break
        if r.logits_state is not None:
            r.logits_state.add(appended)
        # Tokens past a stop were verified but are not output: the cache length never exceeds the history.
        r.num_computed_tokens = min(r.num_computed_tokens, r.num_tokens - 1)
        r.num_draft_context = min(r.num_draft_context, r.num_computed_tokens)
        return appended

    def _append_without_stops(self, r: Request, detok, new_tokens: list[int],
                              logprobs: list[TokenLogprob] | None) -> list[int]:
        """``_append`` for a request with no stop string to look for: its tokens are appended up to a limit (EOS, a
        stop token, max_tokens) and detokenized together, one window decode a request a step rather than one per
        accepted token (the text is the same: the detokenizer's pieces concatenate to the whole decode)."""
        appended, reason = [], None
        for k, token in enumerate(new_tokens):
            r.output_token_ids.append(token)
            if logprobs is not None:
                r.output_logprobs.append(logprobs[k])
            appended.append(token)
            reason = self._limit_reason(r, token)
            if reason:
                break
        _extend_text(r, detok.step(r.output_token_ids))
        if reason:
            _extend_text(r, detok.finish(r.output_token_ids))
            self._finish(r, reason, ending=True)
        return appended

    def _limit_reason(self, r: Request, token: int) -> str | None:
        """Why ``token``, just appended, ends the request (EOS or a stop token, max_tokens, the context), if it does."""
        # No min_tokens check: before min_tokens these tokens are masked out of the distribution.
        p = r.params
        if token in p.stop_token_ids or (token in self.eos_token_ids and not p.ignore_eos):
            return "stop"
        if len(r.output_token_ids) >= r.params.max_tokens or r.num_tokens >= self.max_model_len:
            return "length"
        return None

    def sampler_state(self, request_id: str) -> bytes | None:
        """A seeded request's generator state (None for an unseeded one): what a decode peer's ``finish_transfer``
        takes to go on drawing where this engine stopped. No device sync: a device generator's state is its seed
        and offset, kept on the host."""
        request = self.requests.get(request_id)
        if request is None or request.generator is None:
            return None
        return request.generator.get_state().numpy().tobytes()

    def first_text_delta(self, prompt_token_ids: Sequence[int], params: SamplingParams, first_token: int
                         ) -> str | None:
        """The ``text_delta`` of the first output of a request whose first token is ``first_token`` (what a
        decode peer's ``finish_transfer`` emits for it), or None when that token ends the request.

        A prefill replica streams it while the KV is still moving; nothing here is stored or scheduled.
        """
        r = Request("", list(prompt_token_ids), params)
        r.output_token_ids.append(first_token)
        if self.tokenizer is not None:
            r.detokenizer = self.tokenizer.detokenizer(r.params.skip_special_tokens)
            if _extend_text(r, r.detokenizer.step(r.output_token_ids), params.min_tokens <= 1):
                return None
        if self._limit_reason(r, first_token) is not None:
            return None
        return self._output(r, [first_token]).text_delta

    def _output(self, r: Request, appended: list[int]) -> RequestOutput:
        """The request's output now: its full text so far, and as text_delta the part that became final."""
        end = len(r.output_text)
        if not r.finished and r.params.stop and not r.params.include_stop_str_in_output:
            end -= max(map(len, r.params.stop)) - 1     # a stop string may still begin there (and be cut)
        delta = ""
        if end > r.num_text_sent:
            delta = r.output_text[r.num_text_sent:end]
            r.num_text_sent = end
        logprobs = new_logprobs = None
        if r.params.logprobs is not None:
            logprobs = list(r.output_logprobs)
            new_logprobs = logprobs[len(logprobs) - len(appended):]
        return RequestOutput(r.request_id, r.prompt_token_ids, list(r.output_token_ids), r.output_text,
                             r.finished, r.finish_reason, r.num_cached_tokens, r.spec, appended, delta,
                             logprobs, new_logprobs, _timing(r) if r.finished else None)


def _timing(r: Request) -> RequestTiming:
    now = time.monotonic()
    scheduled = now if r.first_scheduled_time is None else r.first_scheduled_time
    first = now if r.first_token_time is None else r.first_token_time
    return RequestTiming(scheduled - r.arrival_time, max(0.0, first - scheduled), max(0.0, now - first))


def _extend_text(r: Request, new: str, honour_stops: bool = True) -> bool:
    """Add newly detokenized text to ``r.output_text``; True (the text cut at it, or after it with
    include_stop_str_in_output) when a stop string ends in it and ``honour_stops``."""
    if not new:
        return False
    r.output_text += new
    if not r.params.stop or not honour_stops:
        return False
    # Only a stop ending in the new text is new: it begins in its last len(new) + max(len(stop)) - 1 chars.
    start = max(0, len(r.output_text) - len(new) - max(map(len, r.params.stop)) + 1)
    hit = _find_stop(r.output_text, r.params.stop, start)
    if hit is None:
        return False
    begin, stop = hit
    r.output_text = r.output_text[:begin + len(stop) if r.params.include_stop_str_in_output else begin]
    return True


def _find_stop(text: str, stops: Sequence[str], start: int = 0) -> tuple[int, str] | None:
    """Where the earliest stop string in ``text[start:]`` begins, and which (the shortest of those beginning there)."""
    hits = [(i, len(s), s) for i, s in ((text.find(s, start), s) for s in stops) if i >= 0]
    if not hits:
        return None
    begin, _, stop = min(hits)
    return begin, stop


def _set_generator_state(generator: torch.Generator, state: bytes) -> None:
    """``generator.set_state`` from ``LLMEngine.sampler_state``'s bytes; ValueError when it is not a state of this
    kind of generator (another device type, or not a state at all)."""
    try:
        generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"the prefill's sampler state ({len(state)} bytes) does not fit this engine's "
                         f"{generator.device.type} generator: {e}") from None
