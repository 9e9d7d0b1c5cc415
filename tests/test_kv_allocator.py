"""PageAllocator: reference counts, double frees, the prefix cache and its LRU eviction, against a model."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kv.allocator import PageAllocator, chain_hash

NUM_PAGES = 6


class AllocatorModel(RuleBasedStateMachine):
    """Random allocate / share / free / cache / lookup against a plain model of what each page is."""

    hash_fn = staticmethod(chain_hash)

    @initialize()
    def start(self):
        self.alloc = PageAllocator(NUM_PAGES, self.hash_fn)
        self.refs = [0] * NUM_PAGES
        self.entries = {}          # page -> (hash, parent hash, tokens, draft_complete)
        self.lru = []              # cached pages with no reference, least recently freed first
        self.hashes = [None]       # parents to chain new pages to

    # --- helpers --------------------------------------------------------------------------------
    def owner_of(self, page_hash):
        return next((p for p, e in self.entries.items() if e[0] == page_hash), None)

    def in_use(self):
        return [p for p in range(NUM_PAGES) if self.refs[p] > 0]

    # --- rules ----------------------------------------------------------------------------------
    @rule(n=st.integers(0, NUM_PAGES + 1), after=st.none() | st.integers(0, NUM_PAGES - 1))
    def allocate(self, n, after):
        free = [p for p in range(NUM_PAGES) if self.refs[p] == 0 and p not in self.entries]
        if n > len(free) + len(self.lru):
            with pytest.raises(MemoryError):
                self.alloc.allocate(n, after=after)
            return
        pages = self.alloc.allocate(n, after=after)
        assert len(set(pages)) == n
        assert all(self.refs[p] == 0 for p in pages), "handed out a page in use"
        # Runs: right after ``after`` when those pages are free, else one run whenever a free run holds them all.
        wanted = list(range(after + 1, after + 1 + n)) if after is not None else []
        if wanted and all(p in free for p in wanted):
            assert pages == wanted
        elif 0 < n <= len(free) and any(all(p in free for p in range(s, s + n)) for s in range(NUM_PAGES - n + 1)):
            assert pages == list(range(pages[0], pages[0] + n)), f"{pages} is not one run"
        # Free pages go first; only then the least recently used unreferenced cached pages.
        num_evicted = max(0, n - len(free))
        assert sorted(p for p in pages if p in self.entries) == sorted(self.lru[:num_evicted])
        for page in self.lru[:num_evicted]:
            del self.entries[page]
        self.lru = self.lru[num_evicted:]
        for page in pages:
            self.refs[page] = 1

    @precondition(lambda self: any(r > 0 for r in self.refs) or self.lru)
    @rule(data=st.data())
    def share(self, data):
        page = data.draw(st.sampled_from(self.in_use() + self.lru))
        self.alloc.share(page)
        if page in self.lru:
            self.lru.remove(page)
        self.refs[page] += 1

    @rule(data=st.data())
    def share_a_free_page_is_refused(self, data):
        free = [p for p in range(NUM_PAGES) if self.refs[p] == 0 and p not in self.entries]
        if free:
            with pytest.raises(ValueError):
                self.alloc.share(data.draw(st.sampled_from(free)))

    @precondition(lambda self: any(r > 0 for r in self.refs))
    @rule(data=st.data())
    def free(self, data):
        pages = data.draw(st.lists(st.sampled_from(self.in_use()), min_size=1, max_size=3, unique=True))
        self.alloc.free(pages)
        for page in pages:
            self.refs[page] -= 1
            if self.refs[page] == 0 and page in self.entries:
                self.lru.append(page)

    @rule(data=st.data())
    def double_free_raises_and_changes_nothing(self, data):
        page = data.draw(st.integers(0, NUM_PAGES - 1))
        if self.refs[page] > 0:
            return
        before = (list(self.alloc.ref_counts), self.alloc.num_available)
        others = self.in_use()
        with pytest.raises(ValueError):
            self.alloc.free(others[:1] + [page])
        assert (list(self.alloc.ref_counts), self.alloc.num_available) == before

    @precondition(lambda self: any(r > 0 for r in self.refs))
    @rule(data=st.data(), tokens=st.lists(st.integers(0, 2), min_size=2, max_size=2), draft_complete=st.booleans())
    def cache(self, data, tokens, draft_complete):
        page = data.draw(st.sampled_from(self.in_use()))
        parent = data.draw(st.sampled_from(self.hashes))
        page_hash = self.alloc.cache(page, parent, tokens, draft_complete)
        if page in self.entries:
            h, p, t, done = self.entries[page]
            self.entries[page] = (h, p, t, done or draft_complete)
            assert page_hash == h
            return
        assert page_hash == self.hash_fn(parent, tokens)
        if self.owner_of(page_hash) is None:
            self.entries[page] = (page_hash, parent, tuple(tokens), draft_complete)
            self.hashes.append(page_hash)

    @rule(data=st.data(), tokens=st.lists(st.integers(0, 2), min_size=2, max_size=2))
    def lookup(self, data, tokens):
        parent = data.draw(st.sampled_from(self.hashes))
        hit = self.alloc.lookup(parent, tokens)
        owner = self.owner_of(self.hash_fn(parent, tokens))
        if owner is None or self.entries[owner][1:3] != (parent, tuple(tokens)):
            assert hit is None
            return
        page, entry = hit
        assert page == owner
        assert (entry.parent_hash, entry.tokens, entry.draft_complete) == self.entries[owner][1:]

    @rule()
    def reset_prefix_cache(self):
        self.alloc.reset_prefix_cache()
        self.entries.clear()
        self.lru.clear()
        self.hashes = [None]

    # --- invariants -----------------------------------------------------------------------------
    @invariant()
    def counts_match_the_model(self):
        assert self.alloc.pages_in_use == sum(1 for r in self.refs if r > 0)
        assert self.alloc.ref_counts == self.refs
        assert self.alloc.num_available == sum(1 for r in self.refs if r == 0)

    def teardown(self):
        if not hasattr(self, "alloc"):
            return
        for page in range(NUM_PAGES):
            self.alloc.free([page] * self.refs[page])
        assert self.alloc.pages_in_use == 0
        assert self.alloc.num_available == NUM_PAGES
        assert self.alloc.allocate(NUM_PAGES) is not None     # every page can be handed out again


class CollidingAllocatorModel(AllocatorModel):
    """Every page hashes to one of two values: lookups must still verify parent and tokens."""

    hash_fn = staticmethod(lambda parent, tokens: sum(tokens) % 2)


TestAllocator = AllocatorModel.TestCase
TestAllocator.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestCollidingAllocator = CollidingAllocatorModel.TestCase
TestCollidingAllocator.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_double_free_raises():
    alloc = PageAllocator(2)
    (page,) = alloc.allocate(1)
    alloc.free([page])
    with pytest.raises(ValueError, match="double free"):
        alloc.free([page])


def test_eviction_takes_unreferenced_cached_pages_in_lru_order():
    alloc = PageAllocator(4)
    pages = alloc.allocate(4)
    for i, page in enumerate(pages):
        alloc.cache(page, None, [i], draft_complete=True)
    alloc.free([pages[2]])
    alloc.free([pages[0]])
    alloc.free([pages[3]])          # LRU order now: 2, 0, 3; page 1 stays referenced
    assert alloc.lookup(None, [0]) is not None
    alloc.share(pages[0])           # a hit moves it out of the evictable set ...
    alloc.free([pages[0]])          # ... and back in as the most recent
    assert alloc.allocate(2) == [pages[2], pages[3]]
    assert alloc.lookup(None, [2]) is None and alloc.lookup(None, [3]) is None
    assert alloc.lookup(None, [0])[0] == pages[0]
    assert alloc.lookup(None, [1])[0] == pages[1]
    assert alloc.allocate(1) == [pages[0]]
    with pytest.raises(MemoryError):
        alloc.allocate(1)           # page 1 is referenced: never evicted


def test_free_pages_are_used_before_cached_ones():
    alloc = PageAllocator(3)
    (cached,) = alloc.allocate(1)
    alloc.cache(cached, None, [7], draft_complete=False)
    alloc.free([cached])
    assert cached not in alloc.allocate(2)
    assert alloc.lookup(None, [7])[0] == cached


def test_a_colliding_hash_never_returns_a_page_of_other_tokens():
    alloc = PageAllocator(4, hash_fn=lambda parent, tokens: 0)
    a, b = alloc.allocate(2)
    alloc.cache(a, None, [1, 2], draft_complete=True)
    alloc.cache(b, alloc.hash_fn(None, [1, 2]), [3, 4], draft_complete=True)
    assert alloc.lookup(None, [1, 2])[0] == a
    assert alloc.lookup(None, [5, 6]) is None
    assert alloc.lookup(0, [1, 2]) is None          # right tokens, wrong parent
    assert alloc.lookup(0, [3, 4]) is None          # b lost the hash to a: never cached


def test_a_prompt_gets_one_run_after_churn_the_smallest_that_fits():
    alloc = PageAllocator(32)
    a, b, c, d = (alloc.allocate(n) for n in (4, 6, 3, 8))
    alloc.free(b)                        # a hole of 6 at 4..9
    alloc.free(d)                        # with the tail: a hole of 19 at 13..31
    assert alloc.allocate(5) == [4, 5, 6, 7, 8]          # best fit: the 6-hole, not the tail
    assert alloc.allocate(7) == list(range(13, 20))      # the only run that fits
    alloc.free(a)                                        # 0..3 free; 9 and 20..31 free
    # No run of 17: the longest runs first (12 at 20..31, then 4 at 0..3, then page 9).
    assert alloc.allocate(17) == list(range(20, 32)) + [0, 1, 2, 3] + [9]


def test_a_request_grows_right_after_its_last_page_when_free():
    alloc = PageAllocator(16)
    first = alloc.allocate(2)                            # 0, 1
    other = alloc.allocate(2)                            # 2, 3
    assert alloc.allocate(2, after=first[-1]) == [4, 5]  # 2 is taken: a run elsewhere
    alloc.free(other)
    assert alloc.allocate(2, after=first[-1]) == [2, 3]  # free again: the request's run goes on
    assert alloc.allocate(1, after=5) == [6]
    assert alloc.allocate(1, after=15) == [7]            # past the end: the lowest free page
