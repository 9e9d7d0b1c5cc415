"""Page allocator: reference counts, free pages kept as runs, and a prefix cache of full pages with LRU eviction.

Pages with adjacent ids are adjacent in every pool buffer (``kv.pool``), so a request whose pages form runs
moves with one NIXL descriptor per run and group instead of one per page. The allocator therefore hands out
contiguous runs where it can: a request's next pages right after its last one, a prompt's pages from the
smallest free run that holds them all (best fit keeps large runs for large prompts).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np


def chain_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """Hash of a full page, chained to the hash of the page before it."""
    return hash((parent, tuple(tokens)))


@dataclass
class CachedPage:
    page_hash: int
    parent_hash: int | None
    tokens: tuple[int, ...]    # kept to verify a hit: a hash collision must never return wrong pages
    draft_complete: bool       # every draft layer of the page holds the drafter context of all its tokens


class PageAllocator:
    """Hands out page ids; a page is free, in use (ref count > 0), or cached and unreferenced (evictable)."""

    def __init__(self, num_pages: int, hash_fn: Callable[[int | None, Sequence[int]], int] = chain_hash):
        self.num_pages = num_pages
        self.hash_fn = hash_fn
        self.ref_counts = [0] * num_pages
        self._is_free = np.ones(num_pages, dtype=bool)            # free and not cached
        self._num_free = num_pages
        self._evictable: OrderedDict[int, None] = OrderedDict()   # cached pages with ref count 0, LRU first
        self._cached: dict[int, CachedPage] = {}                  # page id -> cache entry
        self._by_hash: dict[int, int] = {}                        # page hash -> page id

    # --- counts ---------------------------------------------------------------------------------
    @property
    def pages_in_use(self) -> int:
        return sum(1 for r in self.ref_counts if r > 0)

    @property
    def num_available(self) -> int:
        """Pages that an allocation can take now: free ones and evictable cached ones."""
        return self._num_free + len(self._evictable)

    @property
    def num_free(self) -> int:
        """Pages neither in use nor cached."""
        return self._num_free

    # --- allocation -----------------------------------------------------------------------------
    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """``n`` pages, free ones first (as few runs as possible, starting at ``after + 1`` when that page is
        free: a request's next pages continue its last one), then the least recently used cached ones."""
        if n > self.num_available:
            raise MemoryError(f"asked for {n} KV pages, {self.num_available} available")
        pages = self._take_free(min(n, self._num_free), None if after is None else after + 1)
        while len(pages) < n:
            page, _ = self._evictable.popitem(last=False)
            self._uncache(page)
            pages.append(page)
        for page in pages:
            self.ref_counts[page] = 1
        return pages

    def _take_free(self, n: int, start: int | None) -> list[int]:
        if n == 0:
            return []
        free = self._is_free
        if start is not None and start + n <= self.num_pages and free[start:start + n].all():
            pages = list(range(start, start + n))
        elif n == 1:
            pages = [int(np.argmax(free))]          # the lowest free page, without building the runs
        else:
            edges = np.flatnonzero(np.diff(free.view(np.int8), prepend=0, append=0))
            starts, lengths = edges[0::2], edges[1::2] - edges[0::2]
            fits = np.flatnonzero(lengths >= n)
            if len(fits):                           # the smallest run that holds them all
                best = fits[np.argmin(lengths[fits])]
                pages = list(range(int(starts[best]), int(starts[best]) + n))
            else:                                   # the longest runs first: the fewest pieces
                pages = []
                for run in np.argsort(-lengths, kind="stable"):
                    take = min(int(lengths[run]), n - len(pages))
                    pages.extend(range(int(starts[run]), int(starts[run]) + take))
                    if len(pages) == n:
                        break
        free[pages] = False
        self._num_free -= n
        return pages

    def _release_free(self, page: int) -> None:
        self._is_free[page] = True
        self._num_free += 1

    def share(self, page: int) -> None:
        """Take one more reference on a page in use or on a cached page."""
        if self.ref_counts[page] == 0:
            if page not in self._evictable:
                raise ValueError(f"page {page} is free; it cannot be shared")
            del self._evictable[page]
        self.ref_counts[page] += 1

    def free(self, pages: Sequence[int]) -> None:
        """Drop one reference on each page; cached pages become evictable, the rest free. All or nothing."""
        # Check the whole list first (a page may appear more than once) so a double free changes nothing.
        for page, count in Counter(pages).items():
            if self.ref_counts[page] < count:
                raise ValueError(f"double free of KV page {page}")
        for page in pages:
            self.ref_counts[page] -= 1
            if self.ref_counts[page] == 0:
                if page in self._cached:
                    self._evictable[page] = None
                else:
                    self._release_free(page)

    # --- prefix cache ---------------------------------------------------------------------------
    def lookup(self, parent_hash: int | None, tokens: Sequence[int]) -> tuple[int, CachedPage] | None:
        """The cached page holding exactly ``tokens`` after ``parent_hash``, verified token by token."""
        page_hash = self.hash_fn(parent_hash, tokens)
        page = self._by_hash.get(page_hash)
        if page is None:
            return None
        entry = self._cached[page]
        if entry.parent_hash != parent_hash or entry.tokens != tuple(tokens):
            return None     # a collision: treat as a miss
        return page, entry

    def cache(self, page: int, parent_hash: int | None, tokens: Sequence[int], draft_complete: bool) -> int:
        """Register a full page in use under its chained hash; returns the hash. Idempotent."""
        if self.ref_counts[page] <= 0:
            raise ValueError(f"page {page} is not in use; only pages in use can be cached")
        entry = self._cached.get(page)
        if entry is not None:
            entry.draft_complete = entry.draft_complete or draft_complete
            return entry.page_hash
        page_hash = self.hash_fn(parent_hash, tokens)
        if page_hash in self._by_hash:
            # Another page holds this hash (same tokens, or a collision): keep the first one.
            return page_hash
        self._cached[page] = CachedPage(page_hash, parent_hash, tuple(tokens), draft_complete)
        self._by_hash[page_hash] = page
        return page_hash

    def _uncache(self, page: int) -> None:
        entry = self._cached.pop(page)
        del self._by_hash[entry.page_hash]

    def reset_prefix_cache(self) -> None:
        """Forget every cached page (evictable ones become free)."""
        for page in list(self._evictable):
            self._uncache(page)
            self._release_free(page)
        self._evictable.clear()
        for page in list(self._cached):
            self._uncache(page)
