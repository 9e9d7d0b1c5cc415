"""Where the drafter's layers live: the unified-pool gates, the ``shared_draft_kv`` decision, the budget split."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from kv.spec import KVLayerSpec

log = logging.getLogger(__name__)

SHARED_DRAFT_KV_MODES = ("auto", "on", "off")
# Page sizes the paged attention kernels and the drafter's block writes are built and tested for.
SUPPORTED_PAGE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class LayoutConfig:
    """The facts about one engine (or one disaggregation peer) that the unified-pool gates read."""

    page_size: int
    draft_page_size: int | None = None        # None: the drafter reads the target's page size
    static_drafting: bool = True              # a fixed number of drafts per step
    pipeline_parallel_size: int = 1
    context_parallel_size: int = 1
    kv_compression: str | None = None
    target_attention_backend: str = "torch"
    draft_attention_backend: str = "torch"


def unified_gate_failures(config: LayoutConfig, peers: Sequence[LayoutConfig] = ()) -> list[str]:
    """Every gate the config (or a peer's) fails, each as a sentence naming the condition."""
    failures = []

    def check(c: LayoutConfig, who: str):
        if c.draft_page_size is not None and c.draft_page_size != c.page_size:
            failures.append(f"{who}drafter page size {c.draft_page_size} differs from the target's {c.page_size}")
        if c.page_size not in SUPPORTED_PAGE_SIZES:
            failures.append(f"{who}page size {c.page_size} is not supported by the drafter path "
                            f"(supported: {', '.join(map(str, SUPPORTED_PAGE_SIZES))})")
        if not c.static_drafting:
            failures.append(f"{who}drafting is dynamic; the unified pool needs static drafting")
        if c.pipeline_parallel_size != 1:
            failures.append(f"{who}pipeline parallelism ({c.pipeline_parallel_size}) is not supported")
        if c.context_parallel_size != 1:
            failures.append(f"{who}context parallelism ({c.context_parallel_size}) is not supported")
        if c.kv_compression:
            failures.append(f"{who}KV compression ({c.kv_compression}) is not supported")
        if c.target_attention_backend != c.draft_attention_backend:
            failures.append(f"{who}attention backends differ (target {c.target_attention_backend}, "
                            f"drafter {c.draft_attention_backend})")

    check(config, "")
    for i, peer in enumerate(peers):
        check(peer, f"peer {i}: ")
        if peer.page_size != config.page_size:
            failures.append(f"peer {i}: page size {peer.page_size} differs from this engine's {config.page_size}")
    return failures


@dataclass(frozen=True)
class KVLayout:
    """The decision: one unified pool or a separate draft pool, and why."""

    mode: str                  # the shared_draft_kv setting asked for
    unified: bool
    reasons: list[str] = field(default_factory=list)   # failed gates (auto fell back) or "off"

    def describe(self) -> str:
        where = "unified pool" if self.unified else "separate draft pool"
        return f"{where} (shared_draft_kv={self.mode})" + (f": {'; '.join(self.reasons)}" if self.reasons else "")


def decide_layout(mode: str, config: LayoutConfig, peers: Sequence[LayoutConfig] = ()) -> KVLayout:
    """``auto`` unifies when every gate passes, else falls back (logged); ``on`` raises; ``off`` separates."""
    if mode not in SHARED_DRAFT_KV_MODES:
        raise ValueError(f"shared_draft_kv must be one of {SHARED_DRAFT_KV_MODES}, got {mode!r}")
    if mode == "off":
        return KVLayout(mode, False, ["shared_draft_kv=off"])
    failures = unified_gate_failures(config, peers)
    if not failures:
        return KVLayout(mode, True)
    if mode == "on":
        raise ValueError("shared_draft_kv=on but the unified KV pool cannot be used: " + "; ".join(failures))
    log.warning("shared_draft_kv=auto: using a separate draft KV pool because %s", "; ".join(failures))
    return KVLayout(mode, False, failures)


def bytes_per_token(specs: Sequence[KVLayerSpec]) -> int:
    return sum(spec.bytes_per_token() for spec in specs)


def split_budget(budget_bytes: int, page_size: int, spaces: Sequence[Sequence[KVLayerSpec]]) -> list[int]:
    """Pages per space from one byte budget, split by bytes per token so every space holds as many tokens."""
    total = bytes_per_token([s for space in spaces for s in space])
    if total == 0:
        raise ValueError("no KV layers to size")
    tokens = budget_bytes // total
    pages = tokens // page_size
    if pages < 1:
        raise ValueError(f"a KV budget of {budget_bytes} bytes holds no page of {page_size} tokens "
                         f"({total * page_size} bytes per page across all layers)")
    return [pages for _ in spaces]
