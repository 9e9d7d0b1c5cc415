"""The scheduler-facing KV cache manager: block tables, slot allocation with lookahead, prefix reuse.

A manager holds one or more page spaces. The unified layout is one space whose pool holds target and
draft layers, so one block table serves both. The separate layout is two spaces (target, draft), each
with its own pages. Every allocation reserves ``lookahead_tokens`` beyond the request's history: room
for the drafter's whole block (``max(num_extra_kv_tokens, block width)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kv.allocator import PageAllocator, chain_hash
from kv.device_tables import DeviceBlockTables
from kv.pool import KVPool
from kv.spec import LayerOwner


@dataclass
class _RequestPages:
    tables: list[list[int]]                                     # per space
    page_hashes: list[int] = field(default_factory=list)        # chained hashes of the full pages so far
    registered: list[int] = field(default_factory=list)         # per space: leading pages registered in the cache
    draft_registered: list[int] = field(default_factory=list)   # per space: leading pages registered draft-complete
    committed: tuple[int, int] = (0, 0)                         # full target / draft pages at the last commit


@dataclass(frozen=True)
class PrefixHit:
    num_tokens: int
    pages: list[list[int]]        # per space
    page_hashes: list[int] = field(default_factory=list)


class KVCacheManager:
    def __init__(self, pools: Sequence[KVPool], *, lookahead_tokens: int = 0,
                 enable_prefix_caching: bool = True, drafter_in_use: bool | None = None, hash_fn=chain_hash):
        if not pools:
            raise ValueError("a KV cache manager needs at least one pool")
        sizes = {pool.page_size for pool in pools}
        if len(sizes) != 1:
            raise ValueError(f"every page space must share one page size, got {sorted(sizes)}")
        if lookahead_tokens < 0:
            raise ValueError("lookahead_tokens must be >= 0")
        self.pools = list(pools)
        self.page_size = sizes.pop()
        self.lookahead_tokens = lookahead_tokens
        self.enable_prefix_caching = enable_prefix_caching
        has_draft = any(pool.has_owner(LayerOwner.DRAFT) for pool in self.pools)
        self.drafter_in_use = has_draft if drafter_in_use is None else drafter_in_use
        self.hash_fn = hash_fn
        self.allocators = [PageAllocator(pool.num_pages, hash_fn) for pool in self.pools]
        self._requests: dict[str, _RequestPages] = {}
        self._device_tables: dict[tuple[int, str], DeviceBlockTables] = {}

    # --- layout ---------------------------------------------------------------------------------
    @property
    def unified(self) -> bool:
        return len(self.pools) == 1

    def space_of(self, owner: LayerOwner) -> int:
        for i, pool in enumerate(self.pools):
            if pool.has_owner(owner):
                return i
        raise KeyError(f"no page space holds {owner.value} layers")

    def pages_needed(self, num_tokens: int) -> int:
        return -(-(num_tokens + self.lookahead_tokens) // self.page_size)

    def pages_in_use(self, space: int | None = None) -> int:
        if space is None:
            return sum(a.pages_in_use for a in self.allocators)
        return self.allocators[space].pages_in_use

    def num_available(self) -> int:
        """Pages an allocation can take in the tightest space."""
        return min(a.num_available for a in self.allocators)

    def block_table(self, request_id: str, space: int = 0) -> list[int]:
        return self._requests[request_id].tables[space]

    def device_block_tables(self, space: int, device: torch.device, rows: int = 64,
                            pages: int = 64) -> DeviceBlockTables:
        """The device copy of space ``space``'s block tables on ``device`` (made at first use with room for ``rows``
        requests of ``pages`` pages; it grows beyond). Freed requests leave it with their pages."""
        key = (space, str(torch.device(device)))
        if key not in self._device_tables:
            self._device_tables[key] = DeviceBlockTables(device, rows, pages)
        return self._device_tables[key]

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    # --- prefix reuse ---------------------------------------------------------------------------
    def probe_prefix(self, token_ids: Sequence[int]) -> PrefixHit:
        """Longest cached prefix of full pages reusable in every space; takes no reference.

        Target layers decide the match; where the drafter is in use a page is reused only if its draft
        layers are complete too. At least one token is always left to compute (its logits are needed).
        """
        if not self.enable_prefix_caching:
            return PrefixHit(0, [[] for _ in self.pools])
        hashes = []
        max_pages = (len(token_ids) - 1) // self.page_size
        pages: list[list[int]] = [[] for _ in self.pools]
        parent = None
        for i in range(max_pages):
            tokens = token_ids[i * self.page_size:(i + 1) * self.page_size]
            found = []
            for space, alloc in enumerate(self.allocators):
                hit = alloc.lookup(parent, tokens)
                if hit is None or (self.drafter_in_use and self.pools[space].has_owner(LayerOwner.DRAFT)
                                   and not hit[1].draft_complete):
                    break
                found.append(hit[0])
            if len(found) < len(self.allocators):
                break
            for space, page in enumerate(found):
                pages[space].append(page)
            parent = self.hash_fn(parent, tokens)
            hashes.append(parent)
        return PrefixHit(len(pages[0]) * self.page_size, pages, hashes)

    # --- allocation -----------------------------------------------------------------------------
    def allocate_slots(self, request_id: str, num_tokens: int, prefix: PrefixHit | None = None) -> bool:
        """Make the request's pages cover ``num_tokens`` plus the lookahead. All or nothing.

        ``prefix`` (first allocation only) installs the pages of a probed prefix hit, shared.
        Returns False, changing nothing, when a space lacks pages.
        """
        state = self._requests.get(request_id)
        if state is not None and prefix is not None and prefix.num_tokens:
            raise ValueError(f"request {request_id} already has pages; a prefix hit only applies at admission")
        target = self.pages_needed(num_tokens)
        if state is not None and all(len(table) >= target for table in state.tables):
            return True         # most decode steps: the pages are there already
        plans = []
        for space, alloc in enumerate(self.allocators):
            have = len(state.tables[space]) if state else 0
            shared = prefix.pages[space] if (prefix and state is None) else []
            # Shared pages that are evictable leave the available count when referenced.
            pinned = sum(1 for p in shared if alloc.ref_counts[p] == 0)
            new = max(0, target - have - len(shared))
            if new + pinned > alloc.num_available:
                return False
            plans.append((shared, new))
        if state is None:
            n = prefix.num_tokens // self.page_size if prefix else 0
            state = _RequestPages(tables=[[] for _ in self.pools], page_hashes=list(prefix.page_hashes) if prefix else [],
                                  registered=[n] * len(self.pools), draft_registered=[n] * len(self.pools))
            self._requests[request_id] = state
        for space, (shared, new) in enumerate(plans):
            alloc = self.allocators[space]
            for page in shared:
                alloc.share(page)
            state.tables[space].extend(shared)
            table = state.tables[space]
            # Right after the request's last page where free: its pages stay one run (one READ descriptor).
            table.extend(alloc.allocate(new, after=table[-1] if table else None))
        return True

    def commit(self, request_id: str, token_ids: Sequence[int], num_target_tokens: int,
               num_draft_tokens: int | None = None) -> None:
        """Register the request's newly full pages in the prefix cache. ``token_ids``: any sequence that slices
        (a request's history view); only the newly full pages' tokens are read.

        ``num_target_tokens`` / ``num_draft_tokens``: positions whose target / draft K/V are stored.
        A target page is cached when full; it is reusable by a drafting request once its draft part is.
        """
        if not self.enable_prefix_caching:
            return
        state = self._requests[request_id]
        num_draft_tokens = num_target_tokens if num_draft_tokens is None else num_draft_tokens
        full_target = min(num_target_tokens, len(token_ids)) // self.page_size
        full_draft = min(num_draft_tokens, len(token_ids)) // self.page_size
        if (full_target, full_draft) == state.committed:
            return          # no page filled since the last commit (most steps): nothing to register
        state.committed = (full_target, full_draft)
        while len(state.page_hashes) < max(full_target, full_draft):
            i = len(state.page_hashes)
            parent = state.page_hashes[-1] if state.page_hashes else None
            state.page_hashes.append(self.hash_fn(parent, token_ids[i * self.page_size:(i + 1) * self.page_size]))
        for space, (pool, alloc) in enumerate(zip(self.pools, self.allocators)):
            has_target = pool.has_owner(LayerOwner.TARGET)
            has_draft = pool.has_owner(LayerOwner.DRAFT)
            full = full_target if has_target else full_draft
            for i in range(state.registered[space], full):
                self._cache_page(alloc, state, space, token_ids, i, draft_complete=(not has_draft) or i < full_draft)
            state.registered[space] = max(state.registered[space], full)
            if has_draft and has_target:
                # Pages cached before their draft part was written become reusable by drafting requests now.
                done = min(full_draft, state.registered[space])
                for i in range(state.draft_registered[space], done):
                    self._cache_page(alloc, state, space, token_ids, i, draft_complete=True)
                state.draft_registered[space] = max(state.draft_registered[space], done)

    def _cache_page(self, alloc: PageAllocator, state: _RequestPages, space: int, token_ids: Sequence[int],
                    i: int, draft_complete: bool) -> None:
        """Cache page ``i`` of a request, but only on top of its own page ``i - 1`` being the cached one."""
        ps = self.page_size
        table = state.tables[space]
        # A hit checks a page's tokens and its parent's hash, not the parent's tokens. Chained under another
        # request's page that only shares the hash (a collision), a page would be spliced onto a different
        # context. Chained under the page this request holds, every cached chain is exact: a parent stays
        # cached as long as its child (every holder of a page holds its parent and frees it after the child).
        # The cost: when a page lost its hash to an identical page computed at the same time by another
        # request, this request's later pages are not cached.
        if i:
            parent = alloc.lookup(state.page_hashes[i - 2] if i > 1 else None, token_ids[(i - 1) * ps:i * ps])
            if parent is None or parent[0] != table[i - 1]:
                return
        alloc.cache(table[i], state.page_hashes[i - 1] if i else None, token_ids[i * ps:(i + 1) * ps],
                    draft_complete=draft_complete)

    def free(self, request_id: str) -> None:
        """Return every page of the request (finished, aborted, failed or preempted). Idempotent."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return
        for mirror in self._device_tables.values():
            mirror.release(request_id)
        for alloc, table in zip(self.allocators, state.tables):
            # Free in reverse so the tail of a sequence is evicted before its shared head.
            alloc.free(list(reversed(table)))

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> list[list[tuple[int, int]]]:
        """A child request sharing the parent's first ``num_tokens``: full pages are shared, the rest copied.

        Returns per space the ``(src, dst)`` page copies the caller must perform before either writes.
        """
        if child_id in self._requests:
            raise ValueError(f"request {child_id} already has pages")
        parent = self._requests[parent_id]
        full = num_tokens // self.page_size
        total = self.pages_needed(num_tokens)
        copies: list[list[tuple[int, int]]] = []
        for space, alloc in enumerate(self.allocators):
            needed = max(0, total - full)
            if needed > alloc.num_available:
                raise MemoryError(f"fork of {parent_id}: {needed} pages needed, {alloc.num_available} available")
        child = _RequestPages(tables=[[] for _ in self.pools], page_hashes=list(parent.page_hashes[:full]),
                              registered=[min(r, full) for r in parent.registered],
                              draft_registered=[min(r, full) for r in parent.draft_registered])
        for space, alloc in enumerate(self.allocators):
            shared = parent.tables[space][:full]
            for page in shared:
                alloc.share(page)
            fresh = alloc.allocate(max(0, total - full))
            child.tables[space] = shared + fresh
            # Only the partly filled page holds tokens of the first num_tokens; the pages after it are
            # lookahead room that the child writes before it reads, so copying them would be wasted bandwidth.
            partial = parent.tables[space][full:full + 1] if num_tokens % self.page_size else []
            copies.append(list(zip(partial, fresh)))
        self._requests[child_id] = child
        return copies
