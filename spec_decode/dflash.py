"""DFlash speculation in the step loop: draft blocks from the draft layers, verify, grow the drafter context;
and ``DFlashFactory``, the ``engine.SpeculatorFactory`` that gives an engine this speculator."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from engine.attention import AttentionMetadata
from engine.cuda_graphs import RaggedGraphs, StepGraphs
from engine.llm import EngineConfig, kv_cache_dtype
from engine.llm_engine import Proposal
from engine.model import AttentionSite, Qwen3Model, fused_linears
from engine.model_runner import (Row, build_metadata, device_metadata, layer_kv_of, pack_inputs, row_tables,
                                 unpack_inputs)
from engine.parallel import OP_CLEAR, OP_DRAFT, OP_STORE, Message
from engine.sampler import LogitsBlock, adjust_logits, draw, probabilities
from engine.scheduler import ScheduledRequest
from engine.sequence import Request, RequestStatus
from kv.device_tables import upload
from kv.manager import KVCacheManager
from kv.spec import LayerOwner
from spec_decode.drafter import DFlashDrafter


def choose_drafts(logits: torch.Tensor, requests: Sequence[Request], emitted_ahead: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Drafts ``[B, K]`` from drafter logits ``[B, K, V]`` (adjusted for the requests' penalties and bias), on the
    device: greedy rows take the argmax, sampled rows draw from their distributions (each seeded row from its own
    generator), which come back for the sampled rows in row order (``[S, K, V]``; None when every row is greedy)
    for verification by rejection sampling. Eager and ahead steps draft through this one function, so a seeded
    row draws the same numbers either way. ``emitted_ahead`` ``[B]``: a step launched ahead's rows' tokens from
    the launched step, which the host has not counted in their outputs yet (``LogitsBlock``)."""
    count = logits.shape[1]
    # The target verifies under the request's bias, min_tokens mask and penalties: drafting under them too keeps
    # acceptance up (the block's own drafts are not known yet, so its counts stop at the anchor).
    blocks = [LogitsBlock(r.logits_state, j * count, count, len(r.output_token_ids),
                          emitted_ahead=None if emitted_ahead is None else emitted_ahead[j])
              for j, r in enumerate(requests) if r.logits_state is not None]
    if blocks:
        logits = adjust_logits(logits.flatten(0, 1), blocks).view_as(logits)
    drafts = logits.argmax(-1)
    sampled = [j for j, r in enumerate(requests) if not r.params.greedy]
    if not sampled:
        return drafts, None
    index = upload(sampled, torch.int64, logits.device)
    q = probabilities(logits[index].flatten(0, 1), [requests[j].params for j in sampled
                                                      for _ in range(count)]).view(len(sampled), count, -1)
    return drafts.index_copy(0, index, draw(q, [requests[j].generator for j in sampled])), q


class DFlashSpeculator:
    """Binds a drafter to its draft layers in the KV manager (the unified pool or a separate one); the
    target lends its embedding and LM head. Under tensor parallelism rank 0 publishes each drafter forward
    and ranks > 0 run it in ``follow``."""

    def __init__(self, drafter: DFlashDrafter, target: Qwen3Model, kv: KVCacheManager, backend: str,
                 num_spec_tokens: int | None = None):
        k = drafter.block_size - 1 if num_spec_tokens is None else num_spec_tokens
        if not 1 <= k <= drafter.block_size - 1:
            raise ValueError(f"num_spec_tokens must be in [1, {drafter.block_size - 1}] for block size "
                             f"{drafter.block_size}, got {num_spec_tokens}")
        if kv.lookahead_tokens < k + 1:
            # The block [anchor, MASK x k] is written after the history: its last slot needs a page too.
            raise ValueError(f"the KV manager reserves {kv.lookahead_tokens} lookahead tokens; drafting "
                             f"{k} tokens needs {k + 1}")
        self.drafter = drafter
        self.target = target
        self.kv = kv
        self.backend = backend
        self.num_spec_tokens = k
        self.capture_layers = drafter.target_layer_ids
        self.space = kv.space_of(LayerOwner.DRAFT)
        self.layer_kv = layer_kv_of(kv, LayerOwner.DRAFT, drafter.config.num_hidden_layers)
        self.tp = target.tp
        self.graphs: StepGraphs | None = None
        self.store_graphs: RaggedGraphs | None = None
        # With graphs, a step's context of at most one block per request waits here (request id -> (request, start,
        # captured rows)) and is stored by the next drafter graph, inside it: no eager launches and no metadata of
        # its own. The rows are a view of the target forward's output, valid until its next forward, which comes
        # after ``propose``; ``propose`` stores or drops every entry, whatever it drafts.
        self._pending: dict[str, tuple[Request, int, torch.Tensor]] = {}
        self._pending_source: torch.Tensor | None = None
        self._ctx_hidden: torch.Tensor | None = None     # the graphs' static context rows [max_batch * width, n*H]
        self._ctx_lens: torch.Tensor | None = None       # context positions per row before its block (0: none)
        self.contexts_in_graph = 0                       # pending contexts a drafter graph stored

    def attention_site(self) -> AttentionSite:
        """Drafter blocks attend non-causally over their context and themselves."""
        return AttentionSite(self.drafter.num_heads, self.layer_kv[0], self.drafter.fc.dtype, causal=False)

    def linear_weights(self) -> list[torch.Tensor]:
        """The context projection and each layer's: q, k and v (blocks), k and v alone (context stores), o, MLP."""
        d = self.drafter
        q_rows = d.num_heads * d.config.head_dim
        return [d.fc] + [w for layer in d.layers for w in (layer.qkv, layer.qkv[q_rows:], layer.o, layer.gate_up,
                                                               layer.down)]

    def fused_linears(self) -> list[tuple[torch.Tensor, dict]]:
        """The draft layers' linears with the work a few-row block folds into them."""
        return fused_linears(self.drafter.layers, self.drafter.tp is not None)

    def enable_graphs(self, max_batch: int, max_pages: int, capture: bool, max_tokens: int | None
                      ) -> list[StepGraphs | RaggedGraphs]:
        """Draft full blocks (``num_spec_tokens`` drafts a row) through ``StepGraphs``, and store contexts of up
        to ``max_tokens`` rows that no draft takes (prompts) through ``RaggedGraphs`` (None: eagerly)."""
        width = self.num_spec_tokens + 1
        self.store_graphs = None if max_tokens is None else RaggedGraphs(
            lambda hidden, positions, meta: self._store(hidden, positions, meta.slot_mapping) or (),
            device=self.drafter.device, max_tokens=max_tokens, max_batch=max_batch, max_pages=max_pages,
            page_size=self.kv.page_size, causal=False, backend=self.backend, capture=capture,
            input_shape=(self.drafter.fc.shape[1],), input_dtype=self.drafter.fc.dtype)
        self._ctx_hidden = torch.zeros(max_batch * width, self.drafter.fc.shape[1], dtype=self.drafter.fc.dtype,
                                       device=self.drafter.device)
        self._ctx_lens = torch.zeros(max_batch, dtype=torch.int64, device=self.drafter.device)
        self.graphs = StepGraphs(lambda ids, positions, meta: (self._store_and_draft(ids, positions, meta, width),),
                                 device=self.drafter.device, query_lens=(width,), max_batch=max_batch,
                                 max_pages=max_pages, page_size=self.kv.page_size, causal=False,
                                 backend=self.backend, capture=capture)
        return [self.graphs] + ([self.store_graphs] if self.store_graphs else [])

    @torch.inference_mode()
    def draft_logits(self, requests: Sequence[Request], num_drafts: int) -> torch.Tensor:
        """Drafter logits ``[B, num_drafts, V]`` for blocks anchored at each request's last token."""
        device = self.drafter.device
        width = num_drafts + 1
        graphed = self.graphs is not None and self.graphs.accepts(len(requests), width)
        pending = [self._take_pending(r) for r in requests]
        if not graphed or any(p is not None and len(p[2]) > width for p in pending):
            self._store_now([p for p in pending if p is not None])
            pending = [None] * len(requests)
        for r, p in zip(requests, pending):
            context = r.num_draft_context + (len(p[2]) if p is not None else 0)
            if context != r.num_computed_tokens or r.num_computed_tokens != r.num_tokens - 1:
                raise RuntimeError(f"request {r.request_id}: drafter context ({context}) must cover "
                                   f"the computed history ({r.num_computed_tokens}) before drafting")
        rows = [Row(r.request_id, r.num_computed_tokens, width) for r in requests]
        positions, meta = build_metadata(self.kv, self.space, rows, causal=False, backend=self.backend, device=device)
        mask = self.drafter.config.mask_token_id
        ids = upload([t for r in requests for t in [r.history[-1]] + [mask] * num_drafts], torch.int64, device)
        if self.tp is not None:
            ints, tensors = pack_inputs(ids, positions, meta)
            self.tp.publish(OP_DRAFT, ints + [len(requests), width], tensors)
        if not graphed:
            return self._draft(ids, positions, meta, width)
        self._stage_context(pending, width, self.graphs.padded(len(requests)))
        logits = self.graphs.run(len(requests), width, ids, positions, meta)[0]
        for p in pending:
            if p is not None:
                p[0].num_draft_context = p[1] + len(p[2])
                self.contexts_in_graph += 1
        return logits

    def can_draft_ahead(self, batch: int) -> bool:
        return self.graphs is not None and self.tp is None and self.graphs.accepts(batch, self.num_spec_tokens + 1)

    @torch.inference_mode()
    def draft_ahead(self, requests: Sequence[Request], anchors: torch.Tensor, starts: torch.Tensor,
                    context: torch.Tensor, context_lens: torch.Tensor,
                    target_metadata: tuple[torch.Tensor, AttentionMetadata]
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``engine.Speculator.draft_ahead``: full blocks through the drafter graph, which stores the context rows
        staged here (``_store_and_draft``) before drafting; drafts chosen as ``propose`` chooses them."""
        width = self.num_spec_tokens + 1
        n = len(requests)
        request_ids = [r.request_id for r in requests]
        if self.space == self.kv.space_of(LayerOwner.TARGET):      # the unified pool: the same pages and slots
            positions, meta = target_metadata[0], dataclasses.replace(target_metadata[1], causal=False)
        else:
            positions, meta = device_metadata(self.kv, self.space, request_ids, starts, width, causal=False,
                                              backend=self.backend)
        ids = torch.cat([anchors, anchors.new_full((n, width - 1), self.drafter.config.mask_token_id)], 1)
        self._ctx_lens[:n].copy_(context_lens)
        self._ctx_lens[n:self.graphs.padded(n)].zero_()
        self._ctx_hidden[:n * width].copy_(context)
        self.contexts_in_graph += n
        return choose_drafts(self.graphs.run(n, width, ids.flatten(), positions, meta)[0], requests, context_lens)

    def _store_and_draft(self, ids, positions, meta, width: int) -> torch.Tensor:
        """The drafter graph's forward: store the staged context of each row (``_ctx_lens`` positions right before
        its block, from ``_ctx_hidden``; none on padded rows), then draft the blocks."""
        rows = ids.shape[0] // width
        lens = self._ctx_lens[:rows, None]
        offsets = torch.arange(width, device=ids.device)
        valid = offsets < lens
        at = torch.where(valid, positions.view(rows, width)[:, :1] - lens + offsets, 0)
        page_size = self.kv.page_size
        pages = meta.block_tables.gather(1, at // page_size).long()
        slots = torch.where(valid, pages * page_size + at % page_size, -1)
        self._store(self._ctx_hidden[:rows * width], at.flatten(), slots.flatten())
        return self._draft(ids, positions, meta, width)

    def _stage_context(self, pending: list[tuple[Request, int, torch.Tensor] | None], width: int, size: int) -> None:
        """Copy the pending context rows into the graph's static inputs: row j's ``width`` slots from its first
        captured row (past its length they are masked), its length into ``_ctx_lens``; padded rows get none."""
        source = self._pending_source
        if source is None or all(p is None for p in pending):
            self._ctx_lens[:size].zero_()
            return
        lens, index = [], []
        for p in pending:
            lens.append(len(p[2]) if p is not None else 0)
            first = (p[2].storage_offset() - source.storage_offset()) // source.stride(0) if p is not None else 0
            index += [min(first + t, len(source) - 1) for t in range(width)]
        staged = upload(lens + index, torch.int64, self.drafter.device)
        self._ctx_lens[:len(pending)].copy_(staged[:len(pending)])
        self._ctx_lens[len(pending):size].zero_()
        torch.index_select(source, 0, staged[len(pending):], out=self._ctx_hidden[:len(pending) * width])

    def _draft(self, ids, positions, meta, width: int) -> torch.Tensor:
        hidden = self.drafter.forward_block(self.target.embed(ids), positions, self.layer_kv, meta)
        hidden = hidden.view(-1, width, hidden.shape[-1])
        # Slot k predicts start + k; the target's LM head (vocab-parallel under TP) gives the logits.
        return self.target.lm_logits(self.drafter.final_norm(hidden[:, 1:], self.backend), self.backend)

    def propose(self, rows: Sequence[ScheduledRequest]) -> list[Proposal]:
        try:
            return self._propose(rows)
        finally:
            # Context no draft took (a row drafting nothing this step, a request preempted or ended) is stored now,
            # before the target forward that follows overwrites the rows it is a view of.
            self._store_now([self._take_pending(r) for r, _, _ in list(self._pending.values())])

    def _propose(self, rows: Sequence[ScheduledRequest]) -> list[Proposal]:
        if not rows:
            return []
        # Rows in one step may carry fewer drafts when the token budget ran short; group by count.
        proposals: dict[int, Proposal] = {}
        for count in sorted({s.num_spec_tokens for s in rows}):
            group = [i for i, s in enumerate(rows) if s.num_spec_tokens == count]
            requests = [rows[i].request for i in group]
            drafts, q = choose_drafts(self.draft_logits(requests, count), requests)
            sampled = [j for j, r in enumerate(requests) if not r.params.greedy]
            where = {j: n for n, j in enumerate(sampled)}
            for j, i in enumerate(group):
                proposals[i] = Proposal(drafts[j], q[where[j]] if j in where else None)
        return [proposals[i] for i in range(len(rows))]

    @torch.inference_mode()
    def store_context(self, items: Sequence[tuple[Request, int, torch.Tensor]]) -> None:
        """Project the captured target hidden states and write them as drafter context K/V, all rows at once."""
        # A finished request's pages are gone, unless it holds them for a decode peer that drafts from them, or it
        # ended in the step now concluding (its pages go to the prefix cache with their context at the step's end).
        items = [(r, start, h) for r, start, h in items if h.shape[0] and (not r.finished or r.hold_pages or r.ending)]
        if self._pending:               # not taken by a draft since the last store (never expected): store it first
            self._store_now([self._take_pending(r) for r, _, _ in list(self._pending.values())])
        for r, start, _ in items:
            if start != r.num_draft_context:
                raise RuntimeError(f"request {r.request_id}: drafter context ends at {r.num_draft_context}, "
                                   f"new context starts at {start}")
        if self.graphs is not None:
            # A running request's block waits for its next draft; a held one's context must be in its pages now.
            later = [(r, start, h) for r, start, h in items if not r.finished and h.shape[0] <= self.num_spec_tokens + 1]
            self._pending_source = _rows_spanned([h for _, _, h in later])
            self._pending = {item[0].request_id: item for item in later} if self._pending_source is not None else {}
            items = [item for item in items if item[0].request_id not in self._pending]
        self._store_now(items)

    def _take_pending(self, r: Request) -> tuple[Request, int, torch.Tensor] | None:
        """The request's pending context, if it still applies: a request preempted or ended since has no use
        for it (a preempted one recomputes its context; an ended one's pages may belong to another request)."""
        item = self._pending.pop(r.request_id, None)
        if item is None or r.status != RequestStatus.RUNNING or item[1] != r.num_draft_context:
            return None
        return item

    def _store_now(self, items: Sequence[tuple[Request, int, torch.Tensor] | None]) -> None:
        """Store context rows eagerly, all requests in one forward."""
        items = [item for item in items if item is not None]
        if not items:
            return
        rows = [Row(r.request_id, start, h.shape[0]) for r, start, h in items]
        if self.store_graphs is not None and self.tp is None:
            tables, mirror, table_rows = row_tables(self.kv, self.space, rows, self.drafter.device)
            if self.store_graphs.accepts(sum(r.num_tokens for r in rows), len(rows), max(map(len, tables))):
                self.store_graphs.run([r.start for r in rows], [r.num_tokens for r in rows], table_rows,
                                      mirror.table, [h for _, _, h in items])
                for r, start, h in items:
                    r.num_draft_context = start + h.shape[0]
                return
        positions, meta = build_metadata(self.kv, self.space, rows, causal=False, backend=self.backend,
                                         device=self.drafter.device)
        if self.tp is not None:
            # Every rank holds the same captured hidden states (the residual stream is replicated); the engine
            # passes row slices of them, so the rows' offsets tell the other ranks which to store.
            index = torch.cat([torch.arange(h.storage_offset() // h.stride(0), h.storage_offset() // h.stride(0)
                                            + h.shape[0]) for _, _, h in items])
            self.tp.publish(OP_STORE, (), [positions, meta.slot_mapping, index])
        self._store(torch.cat([h for _, _, h in items]), positions, meta.slot_mapping)
        for r, start, h in items:
            r.num_draft_context = start + h.shape[0]

    def _store(self, captured: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        context = self.drafter.project_context(captured, self.backend)
        self.drafter.store_context(context, positions, self.layer_kv, slot_mapping, self.backend)

    def clear_context(self, request: Request) -> None:
        """Zero the draft layers over the request's history: the drafter context of an engine that never
        received it (the no-draft-transfer ablation)."""
        self._pending.pop(request.request_id, None)
        table = self.kv.block_table(request.request_id, self.space)
        pages = torch.tensor(table[:-(-request.num_draft_context // self.kv.page_size)], dtype=torch.int64)
        if self.tp is not None:
            self.tp.publish(OP_CLEAR, (), [pages])
        self._clear(pages)

    def _clear(self, pages: torch.Tensor) -> None:
        for layer in self.layer_kv:
            layer.k_cache[pages.to(layer.k_cache.device)] = 0
            layer.v_cache[pages.to(layer.v_cache.device)] = 0

    @torch.inference_mode()
    def follow(self, message: Message, captured: torch.Tensor | None) -> None:
        """A rank > 0: the drafter forward rank 0 published (``captured``: the last target forward's)."""
        if message.op == OP_DRAFT:
            ids, positions, meta, (_, width), _ = unpack_inputs(message, self.backend)
            self._draft(ids, positions, meta, width)
        elif message.op == OP_STORE:
            positions, slot_mapping, index = message.tensors
            self._store(captured[index.to(captured.device)], positions, slot_mapping)
        elif message.op == OP_CLEAR:
            self._clear(message.tensors[0])
        else:
            raise ValueError(f"unknown step message op {message.op}")


def _rows_spanned(slices: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One 2-D view over the rows of ``slices`` (row slices of one tensor, as the engine passes the captured
    hidden states) from the first to the last, for a single gather; None when they are not such slices."""
    if not slices:
        return None
    first = min(slices, key=lambda h: h.storage_offset())
    stride = first.stride()
    if any(h.dim() != 2 or h.stride() != stride or stride[1] != 1 or h.shape[1] != first.shape[1]
           or h.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() for h in slices):
        return None
    end = max(h.storage_offset() + h.shape[0] * stride[0] for h in slices)
    return first.as_strided((-(-(end - first.storage_offset()) // stride[0]), first.shape[1]), stride,
                            first.storage_offset())


class UnboundDFlash:
    """``engine.UnboundSpeculator``: a DFlash drafter loaded for a target, before the engine's KV exists."""

    def __init__(self, drafter: DFlashDrafter, target: Qwen3Model, config: EngineConfig):
        self.drafter = drafter
        self.target = target
        self.backend = config.backend
        self.num_spec_tokens = config.num_spec_tokens
        self.kv_layer_specs = drafter.kv_layer_specs(kv_cache_dtype(config.draft_kv_cache_dtype, target.dtype))
        # The block [anchor, MASK x k] is written after the history: up to block_size slots past it.
        self.lookahead_tokens = drafter.block_size

    def bind(self, kv: KVCacheManager) -> DFlashSpeculator:
        return DFlashSpeculator(self.drafter, self.target, kv, self.backend, self.num_spec_tokens)


class DFlashFactory:
    """``engine.SpeculatorFactory`` for DFlash: loads the drafter that ``EngineConfig.draft`` names, in the
    target's device and dtype, or adopts ``drafter``, one already in memory (benchmarks build random ones)."""

    def __init__(self, drafter: DFlashDrafter | None = None):
        self.drafter = drafter

    def __call__(self, model: Qwen3Model, config: EngineConfig) -> UnboundDFlash:
        drafter = self.drafter
        if drafter is None:
            if config.draft is None:
                raise ValueError("DFlashFactory has no drafter: set EngineConfig.draft or pass one")
            drafter = DFlashDrafter.from_pretrained(config.draft, model, device=config.device, dtype=model.dtype)
        else:
            drafter.config.check_target(model.config, "the given drafter")
            if model.tp is not None and drafter.tp is not model.tp:
                raise ValueError("a drafter given in memory is not sharded for the tensor-parallel target; "
                                 "load it from EngineConfig.draft")
        return UnboundDFlash(drafter, model, config)
