"""One request's state in the engine, and the parameters that decide how it samples and stops."""

from __future__ import annotations

import enum
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.sampler import LogitsState


MAX_LOGPROBS = 20          # OpenAI's top_logprobs limit
MAX_LOGIT_BIAS = 100.0


GREEDY_BELOW_TEMPERATURE = 1e-5


def generator_seed(seed: int) -> int:
    """A request's seed as its generator's: all 64 bits mixed (murmur3's finaliser) into every bit, the low 32 among
    them, which are all a CPU generator uses of its seed (seeds 2^32 apart would otherwise draw alike)."""
    x = seed & 0xFFFF_FFFF_FFFF_FFFF
    x = ((x ^ (x >> 33)) * 0xFF51_AFD7_ED55_8CCD) & 0xFFFF_FFFF_FFFF_FFFF
    x = ((x ^ (x >> 33)) * 0xC4CE_B9FE_1A85_EC53) & 0xFFFF_FFFF_FFFF_FFFF
    return x ^ (x >> 33)


@dataclass(frozen=True)
class SamplingParams:
    """How a request samples and stops (OpenAI / vLLM semantics); validated here, token ids against the
    vocabulary when the engine takes the request."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0                 # 0: no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # Per emitted token: its log-probability and the top ``logprobs`` alternatives, from the target's raw
    # logits (log_softmax of the model output, before temperature, penalties and bias: vLLM's default).
    logprobs: int | None = None
    stop_token_ids: tuple[int, ...] = ()            # end like EOS (the token is kept), whatever ignore_eos says
    include_stop_str_in_output: bool = False
    # Before this many output tokens EOS and stop_token_ids are masked and no stop is honoured. Not checked
    # against max_tokens (max_tokens wins): a prefill peer runs the request with max_tokens=1.
    min_tokens: int = 0
    # token id -> value added to its logit; a dict or pairs, stored as sorted pairs (hashable).
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0      # OpenAI: minus this once a token occurs in the output
    frequency_penalty: float = 0.0     # OpenAI: minus this per occurrence in the output
    repetition_penalty: float = 1.0    # HF / vLLM: over prompt and output, positive logits divided, negative multiplied
    skip_special_tokens: bool = True   # the text leaves special tokens (EOS, chat markers) out

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if isinstance(self.stop_token_ids, int):
            raise ValueError(f"stop_token_ids must be a sequence of token ids, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be integers >= 0, got {self.stop_token_ids!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        bias = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        try:
            bias = dict(bias)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}") from None
        for token, value in bias.items():
            if not _is_int(token) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
            if not _is_number(value) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                                 f"got {value!r} for token {token}")
        object.__setattr__(self, "logit_bias", tuple(sorted((t, float(v)) for t, v in bias.items())))
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty < float("inf"):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        if not isinstance(self.skip_special_tokens, bool):
            raise ValueError(f"skip_special_tokens must be a boolean, got {self.skip_special_tokens!r}")

    @property
    def greedy(self) -> bool:
        # Below this, logits / temperature overflows to inf (NaN probabilities); the limit of such a
        # temperature is the argmax anyway.
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def penalised(self) -> bool:
        """Some penalty depends on the tokens so far (then the engine keeps per-token counts)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability under the target's raw logits, and the top alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()     # (token id, logprob), best first; SamplingParams.logprobs of them


@dataclass(frozen=True)
class Continuation:
    """What a request already gave out before the engine running it was lost: its output tokens (with their
    logprobs entries, when it asked for them) and how many characters of their text reached the client. A request
    added with one goes on from there as that engine would have: it computes its prompt and these tokens, its
    output counts them (max_tokens, min_tokens, the penalties), its stop strings see their text, and its text
    deltas begin after the text sent. Its draws are not the lost engine's: a seeded sampled request would go on
    otherwise than it would have (greedy output goes on alike)."""

    output_token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    num_text_sent: int = 0

    def __post_init__(self):
        object.__setattr__(self, "output_token_ids", tuple(self.output_token_ids))
        object.__setattr__(self, "logprobs", tuple(self.logprobs))


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    TRANSFERRING = "transferring"      # decode side: pages reserved, a peer's KV is being read into them
    FINISHED = "finished"


@dataclass(frozen=True)
class RequestTiming:
    """Where a finished request's time went in its engine, in seconds: waiting to be scheduled (queue), from its
    first scheduled step to its first token (its prompt computed: prefill), and from its first token to its end
    (decode). A request that takes over a transferred KV cache waits, in queue, for its pages and their READ."""

    queue_s: float
    prefill_s: float
    decode_s: float


@dataclass
class SpecStats:
    """Speculative-decoding counts of one request (or of a whole engine)."""

    num_drafts: int = 0                # verification steps that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    acceptance_lengths: list[int] = field(default_factory=list)   # per step: accepted + 1

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft_tokens:
            self.accepted_per_position.extend([0] * (num_draft_tokens - len(self.accepted_per_position)))
        for k in range(num_accepted):
            self.accepted_per_position[k] += 1
        self.acceptance_lengths.append(num_accepted + 1)

    def merge(self, other: "SpecStats") -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        n = len(other.accepted_per_position)
        if len(self.accepted_per_position) < n:
            self.accepted_per_position.extend([0] * (n - len(self.accepted_per_position)))
        for k, count in enumerate(other.accepted_per_position):
            self.accepted_per_position[k] += count

    @property
    def mean_acceptance_length(self) -> float | None:
        if not self.num_drafts:
            return None
        return 1.0 + self.num_accepted_tokens / self.num_drafts


# eq=False: a request is its object. Field-by-field equality made the scheduler's membership tests compare every
# field of every running request (0.5 ms of host time a step at batch 32 on the H200 machine).
@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0       # positions whose target K/V are in the cache
    num_draft_context: int = 0         # positions whose drafter context K/V are in the draft layers
    num_cached_tokens: int = 0         # prompt tokens reused from the prefix cache at admission
    num_reused_tokens: int = 0         # decode side of a transfer: prompt tokens whose pages it had (not READ)
    finish_reason: str | None = None   # "stop" | "length" | "abort" | "error"
    output_text: str = ""
    detokenizer: object | None = None  # engine.tokenizer.IncrementalDetokenizer, made at the first append
    num_text_sent: int = 0             # characters of output_text already given out as text_delta
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    spec: SpecStats = field(default_factory=SpecStats)
    generator: torch.Generator | None = None
    draft_context_valid: bool = True   # False: the drafter context over the prompt never arrived (ablation)
    hold_pages: bool = False           # keep the pages after finishing, until released (prefill for a peer)
    ending: bool = False               # finished in the step now concluding: its pages go at the step's end
    abort_after_transfer: bool = False  # aborted while its KV was being read: free the pages when the READ ends
    output_logprobs: list[TokenLogprob] = field(default_factory=list)   # per output token, when params.logprobs is set
    logits_state: LogitsState | None = None   # device tensors for penalties, bias, min_tokens (None: none set)

    def __post_init__(self):
        if self.params.seed is not None and self.generator is None:
            self.generator = torch.Generator().manual_seed(generator_seed(self.params.seed))

    @property
    def history(self) -> "TokenHistory":
        """Prompt and output as one sequence without copying either: what a step reads of a request costs what
        it reads, not the request's length."""
        return TokenHistory(self.prompt_token_ids, self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def in_prefill(self) -> bool:
        """More than the last token still to compute: prefill (or recompute after preemption)."""
        return self.num_tokens - self.num_computed_tokens > 1

    @property
    def finished(self) -> bool:
        return self.status == RequestStatus.FINISHED


class TokenHistory(Sequence):
    """A read-only view of a request's prompt followed by its output: ``len``, an index and a slice (a new list of
    the ids in it) cost O(1) and O(slice length), whatever the prompt's length."""

    __slots__ = ("_prompt", "_output")

    def __init__(self, prompt: list[int], output: list[int]):
        self._prompt, self._output = prompt, output

    def __len__(self) -> int:
        return len(self._prompt) + len(self._output)

    def __getitem__(self, index):
        n = len(self._prompt)
        if isinstance(index, slice):
            start, stop, stride = index.indices(n + len(self._output))
            if stride != 1:
                return [self[i] for i in range(start, stop, stride)]
            if stop <= n:
                return self._prompt[start:stop]
            if start >= n:
                return self._output[start - n:stop - n]
            return self._prompt[start:] + self._output[:stop - n]
        if index < 0:
            index += n + len(self._output)
        if not 0 <= index < n + len(self._output):
            raise IndexError("token index out of range")
        return self._prompt[index] if index < n else self._output[index - n]
