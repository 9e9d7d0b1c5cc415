"""One request's state in the engine, and the parameters that decide how it samples and stops."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0                 # 0: no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    TRANSFERRING = "transferring"      # decode side: pages reserved, a peer's KV is being read into them
    FINISHED = "finished"


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


@dataclass
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
    finish_reason: str | None = None   # "stop" | "length" | "abort" | "error"
    output_text: str = ""
    detokenizer: object | None = None  # engine.tokenizer.IncrementalDetokenizer, made at the first append
    num_text_sent: int = 0             # characters of output_text already given out as text_delta
    num_preemptions: int = 0
    first_token_time: float | None = None
    spec: SpecStats = field(default_factory=SpecStats)
    generator: torch.Generator | None = None
    draft_context_valid: bool = True   # False: the drafter context over the prompt never arrived (ablation)
    hold_pages: bool = False           # keep the pages after finishing, until released (prefill for a peer)
    abort_after_transfer: bool = False  # aborted while its KV was being read: free the pages when the READ ends

    def __post_init__(self):
        if self.params.seed is not None and self.generator is None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

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
