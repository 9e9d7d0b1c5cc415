"""KVCacheManager: block tables, lookahead, prefix reuse (target required, draft optional), fork, free."""

import itertools

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, rule

from kv.allocator import chain_hash
from kv.manager import KVCacheManager, PrefixHit
from kv.pool import KVPool
from kv.spec import LayerOwner, make_layer_specs

T, D = LayerOwner.TARGET, LayerOwner.DRAFT
PS = 2        # tokens per page: small, so prompts cross many page boundaries


def target_specs(n=2):
    return make_layer_specs(T, n, torch.float8_e4m3fn, 2, 4)


def draft_specs(n=1):
    return make_layer_specs(D, n, torch.bfloat16, 1, 4)


def make_manager(layout, num_pages=16, draft_pages=None, **kwargs):
    if layout == "unified":
        pools = [KVPool(target_specs() + draft_specs(), PS, num_pages)]
    elif layout == "separate":
        pools = [KVPool(target_specs(), PS, num_pages), KVPool(draft_specs(), PS, draft_pages or num_pages)]
    elif layout == "target_only":
        pools = [KVPool(target_specs(), PS, num_pages)]
    else:
        raise ValueError(layout)
    return KVCacheManager(pools, **kwargs)


def admit(kv, rid, tokens, num_draft=None):
    """Probe, allocate and commit a whole prompt, as the scheduler and runner do; returns the hit."""
    hit = kv.probe_prefix(tokens)
    assert kv.allocate_slots(rid, len(tokens), hit)
    kv.commit(rid, tokens, len(tokens), num_draft)
    return hit


def snapshot(kv, rids):
    return ([kv.pages_in_use(s) for s in range(len(kv.pools))], kv.num_available(),
            {r: [list(kv.block_table(r, s)) for s in range(len(kv.pools))] for r in rids if kv.has_request(r)})


# --- the random model ---------------------------------------------------------------------------

BASES = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [5, 6, 7, 8, 20, 21, 22, 23, 24, 25], [30, 31, 32, 33, 34, 35, 36, 37]]


@st.composite
def prompts(draw):
    """Prompts that share prefixes often (so prefix reuse happens) and diverge inside and across pages."""
    base = draw(st.sampled_from(BASES))
    head = base[:draw(st.integers(0, len(base)))]
    return head + draw(st.lists(st.integers(0, 3), min_size=0 if head else 1, max_size=5))


class Request:
    def __init__(self, tokens, computed, drafted):
        self.tokens = list(tokens)
        self.computed = computed       # positions whose target K/V are stored
        self.drafted = drafted         # positions whose draft-layer K/V are stored


class ManagerModel(RuleBasedStateMachine):
    """Random admit / extend / commit / fork / free over several requests, against a model of page contents.

    The model records, for every page slot, which token prefix's K/V it holds (K/V at a position depend on
    every token up to it). A prefix hit must hand out pages whose slots hold exactly the prompt's prefix,
    draft layers included where the drafter is in use; and no request may write a page another one holds.
    """

    layout = "unified"
    drafter_in_use = True
    hash_fn = staticmethod(chain_hash)
    requests = Bundle("requests")

    @initialize(lookahead=st.integers(0, 3), num_pages=st.integers(6, 14))
    def start(self, lookahead, num_pages):
        self.kv = make_manager(self.layout, num_pages=num_pages, draft_pages=num_pages + 2,
                               lookahead_tokens=lookahead, drafter_in_use=self.drafter_in_use, hash_fn=self.hash_fn)
        self.live: dict[str, Request] = {}
        self.spaces = range(len(self.kv.pools))
        # (space, page) -> {slot: prefix} for target and draft layers separately.
        self.target_content = {}
        self.draft_content = {}
        self.next_id = 0

    # --- model helpers --------------------------------------------------------------------------
    def table(self, rid, space):
        return self.kv.block_table(rid, space)

    def holders(self, space, page):
        return [r for r in self.live if page in self.table(r, space)]

    def tracks_draft(self, space):
        return self.drafter_in_use and self.kv.pools[space].has_owner(D)

    def write(self, rid, start, end, draft):
        """The runner stores K/V for positions [start, end) of ``rid``: into its own pages only."""
        req = self.live[rid]
        for space in self.spaces:
            pool = self.kv.pools[space]
            if not pool.has_owner(D if draft else T) or (draft and not self.drafter_in_use):
                continue
            content = self.draft_content if draft else self.target_content
            for pos in range(start, end):
                page = self.table(rid, space)[pos // PS]
                others = [r for r in self.holders(space, page) if r != rid]
                # Target K/V never go into a shared page. Draft K/V may (a forked child shares full pages
                # whose draft part is still due) but only where every holder has the same prefix: same values.
                assert not others or (draft and all(self.live[r].tokens[:pos + 1] == req.tokens[:pos + 1]
                                                    for r in others)), f"{rid} writes page {page} of {others}"
                content.setdefault((space, page), {})[pos % PS] = tuple(req.tokens[:pos + 1])

    def forget_new_pages(self, rid, old_lengths):
        """Pages just handed to ``rid`` hold nothing it wrote: drop what the model knew about them."""
        for space in self.spaces:
            for page in self.table(rid, space)[old_lengths[space]:]:
                self.target_content.pop((space, page), None)
                self.draft_content.pop((space, page), None)

    def check_hit(self, hit, tokens):
        assert hit.num_tokens % PS == 0 and hit.num_tokens < max(len(tokens), 1)
        for space in self.spaces:
            assert len(hit.pages[space]) == hit.num_tokens // PS
            for i, page in enumerate(hit.pages[space]):
                expected = {j: tuple(tokens[:i * PS + j + 1]) for j in range(PS)}
                if self.kv.pools[space].has_owner(T):
                    assert self.target_content.get((space, page)) == expected, f"space {space} page {page}: wrong K/V"
                if self.tracks_draft(space):
                    assert self.draft_content.get((space, page)) == expected, f"space {space} page {page}: draft"

    def check_unchanged(self, before):
        assert snapshot(self.kv, self.live) == before

    def compute(self, rid, end, lag):
        """Run the target up to ``end`` and the drafter context up to ``end - lag``; then commit."""
        req = self.live[rid]
        self.write(rid, req.computed, end, draft=False)
        req.computed = end
        drafted = max(req.drafted, end - lag) if self.drafter_in_use else end
        self.write(rid, req.drafted, drafted, draft=True)
        req.drafted = drafted
        self.kv.commit(rid, req.tokens, req.computed, req.drafted if self.drafter_in_use else None)

    # --- rules ----------------------------------------------------------------------------------
    @rule(target=requests, tokens=prompts(), lag=st.integers(0, 3))
    def admit(self, tokens, lag):
        rid = f"r{self.next_id}"
        self.next_id += 1
        hit = self.kv.probe_prefix(tokens)
        self.check_hit(hit, tokens)
        before = snapshot(self.kv, self.live)
        if not self.kv.allocate_slots(rid, len(tokens), hit):
            self.check_unchanged(before)
            assert not self.kv.has_request(rid)
            return rid
        for space in self.spaces:
            assert self.table(rid, space)[:len(hit.pages[space])] == hit.pages[space]
            assert len(self.table(rid, space)) == self.kv.pages_needed(len(tokens))
        self.forget_new_pages(rid, [len(pages) for pages in hit.pages])
        self.live[rid] = Request(tokens, hit.num_tokens, hit.num_tokens)
        self.compute(rid, len(tokens), lag)
        return rid

    @rule(rid=requests, new=st.lists(st.integers(0, 3), min_size=1, max_size=4), lag=st.integers(0, 3))
    def extend(self, rid, new, lag):
        if rid not in self.live:
            return
        req = self.live[rid]
        before = snapshot(self.kv, self.live)
        if not self.kv.allocate_slots(rid, len(req.tokens) + len(new)):
            self.check_unchanged(before)
            return
        self.forget_new_pages(rid, [len(t) for t in before[2][rid]])
        req.tokens += new
        self.compute(rid, len(req.tokens), lag)

    @rule(rid=requests)
    def draft_catches_up(self, rid):
        if rid in self.live:
            self.compute(rid, self.live[rid].computed, 0)

    @rule(rid=requests, target=requests)
    def fork(self, rid):
        child = f"r{self.next_id}"
        self.next_id += 1
        if rid not in self.live:
            return child
        parent = self.live[rid]
        n = parent.computed
        before = snapshot(self.kv, self.live)
        try:
            copies = self.kv.fork(rid, child, n)
        except MemoryError:
            self.check_unchanged(before)
            return child
        full = n // PS
        for space in self.spaces:
            ptable, ctable = self.table(rid, space), self.table(child, space)
            assert ctable[:full] == ptable[:full]
            assert len(ctable) == self.kv.pages_needed(n)
            assert not set(ctable[full:]) & set(ptable)
            # Exactly the partly filled page is copied; full pages are shared, later ones hold nothing yet.
            assert copies[space] == ([(ptable[full], ctable[full])] if n % PS else [])
            for page in ctable[full:]:
                self.target_content.pop((space, page), None)
                self.draft_content.pop((space, page), None)
            for src, dst in copies[space]:
                for content in (self.target_content, self.draft_content):
                    if (space, src) in content:
                        content[(space, dst)] = dict(content[(space, src)])
        self.live[child] = Request(parent.tokens[:n], n, min(parent.drafted, n))
        return child

    @rule(rid=consumes(requests))
    def free(self, rid):
        self.kv.free(rid)
        self.live.pop(rid, None)
        assert not self.kv.has_request(rid)
        self.kv.free(rid)       # idempotent

    # --- invariants -----------------------------------------------------------------------------
    @invariant()
    def tables_cover_the_lookahead_and_pages_are_shared_only_for_equal_prefixes(self):
        if not hasattr(self, "kv"):
            return
        for space in self.spaces:
            owners = {}
            for rid, req in self.live.items():
                table = self.table(rid, space)
                assert len(table) >= self.kv.pages_needed(len(req.tokens))
                assert len(set(table)) == len(table)
                for i, page in enumerate(table):
                    owners.setdefault(page, []).append((rid, i))
            for page, users in owners.items():
                (rid0, i0), rest = users[0], users[1:]
                for rid, i in rest:
                    assert i == i0, f"page {page} at index {i0} of {rid0} and {i} of {rid}"
                    end = (i + 1) * PS
                    a, b = self.live[rid0], self.live[rid]
                    assert end <= min(a.computed, b.computed), f"page {page} shared but not full"
                    assert a.tokens[:end] == b.tokens[:end], f"page {page} shared by different prefixes"
            assert self.kv.pages_in_use(space) == len(owners)

    def teardown(self):
        if not hasattr(self, "kv"):
            return
        for rid in list(self.live):
            self.kv.free(rid)
        assert all(self.kv.pages_in_use(space) == 0 for space in self.spaces)
        assert self.kv.pages_in_use() == 0


def machine(name, **attrs):
    cls = type(name, (ManagerModel,), attrs)
    case = cls.TestCase
    case.settings = settings(max_examples=50, stateful_step_count=30, deadline=None)
    return case


TestUnifiedDrafting = machine("UnifiedDrafting")
TestUnifiedNoDrafter = machine("UnifiedNoDrafter", drafter_in_use=False)
TestSeparateDrafting = machine("SeparateDrafting", layout="separate")
TestTargetOnly = machine("TargetOnly", layout="target_only")
TestUnifiedConstantHash = machine("UnifiedConstantHash", hash_fn=staticmethod(lambda parent, tokens: 0))
# Hashes that ignore the parent collide for every equal page in a different context.
TestUnifiedParentBlindHash = machine("UnifiedParentBlindHash", hash_fn=staticmethod(lambda p, t: hash(tuple(t))))
TestSeparateParentBlindHash = machine("SeparateParentBlindHash", layout="separate",
                                      hash_fn=staticmethod(lambda p, t: hash(tuple(t))))


# --- prefix reuse -------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["unified", "separate", "target_only"])
def test_a_second_request_reuses_full_prefix_pages_only(layout):
    kv = make_manager(layout)
    prompt = [1, 2, 3, 4, 5]                        # pages [1 2] [3 4] [5]
    admit(kv, "a", prompt)
    hit = kv.probe_prefix(prompt + [9])
    assert hit.num_tokens == 4
    for space in range(len(kv.pools)):
        assert hit.pages[space] == kv.block_table("a", space)[:2]
    assert kv.allocate_slots("b", 6, hit)
    for space in range(len(kv.pools)):
        a, b = kv.block_table("a", space), kv.block_table("b", space)
        assert b[:2] == a[:2] and not set(b[2:]) & set(a)
    # Same prompt again: its last token's page is never reused, even when that page is full.
    admit(kv, "c", [1, 2, 3, 4])
    assert kv.probe_prefix([1, 2, 3, 4]).num_tokens == 2
    assert kv.probe_prefix([1, 2, 3, 4, 5]).num_tokens == 4
    assert kv.probe_prefix([1, 2, 3]).num_tokens == 2
    assert kv.probe_prefix([1, 2]).num_tokens == 0
    assert kv.probe_prefix([]).num_tokens == 0


def test_pages_divergent_after_a_shared_page_are_not_reused():
    kv = make_manager("unified")
    admit(kv, "a", [1, 2, 3, 4, 5, 6, 7])
    hit = kv.probe_prefix([1, 2, 3, 9, 5, 6, 7])
    assert hit.num_tokens == 2 and hit.pages[0] == kv.block_table("a")[:1]


def test_a_prefix_hit_is_refcounted_and_survives_the_first_owner():
    kv = make_manager("unified")
    admit(kv, "a", [1, 2, 3, 4, 5])
    hit = admit(kv, "b", [1, 2, 3, 4, 6])
    kv.free("a")
    assert kv.pages_in_use() == len(kv.block_table("b"))
    assert kv.probe_prefix([1, 2, 3, 4, 0]).pages == hit.pages
    kv.free("b")
    assert kv.pages_in_use() == 0
    assert kv.probe_prefix([1, 2, 3, 4, 0]).pages == hit.pages       # cached, unreferenced, still reusable


def test_prefix_caching_off_never_hits():
    kv = make_manager("unified", enable_prefix_caching=False)
    admit(kv, "a", [1, 2, 3, 4, 5])
    assert kv.probe_prefix([1, 2, 3, 4, 5]).num_tokens == 0


@pytest.mark.parametrize("layout", ["unified", "separate"])
def test_a_constant_hash_never_returns_pages_of_other_tokens(layout):
    kv = make_manager(layout, hash_fn=lambda parent, tokens: 0)
    admit(kv, "a", [1, 2, 3, 4, 5])
    assert kv.probe_prefix([7, 8, 3, 4, 5]).num_tokens == 0
    assert kv.probe_prefix([1, 7, 3, 4, 5]).num_tokens == 0
    hit = kv.probe_prefix([1, 2, 3, 4, 5])
    assert hit.num_tokens == 2          # page two collides with page one: it is never cached, never hit
    assert all(pages == kv.block_table("a", s)[:1] for s, pages in enumerate(hit.pages))


@pytest.mark.parametrize("layout", ["unified", "separate"])
def test_a_parent_blind_hash_never_returns_a_page_from_another_context(layout):
    """Equal page tokens under a different earlier prefix hash alike here; their K/V differ."""
    kv = make_manager(layout, num_pages=8, hash_fn=lambda parent, tokens: hash(tuple(tokens)))
    # "r" computes [1 1][5 5][7 7] alongside "a" but loses pages one and two to a's cache entries,
    # so only its third page is cached, chained to a's second page.
    hit_r = kv.probe_prefix([1, 1, 5, 5, 7, 7, 0])
    assert kv.allocate_slots("r", 7, hit_r)
    admit(kv, "a", [1, 1, 5, 5, 0])
    kv.commit("r", [1, 1, 5, 5, 7, 7, 0], 7)
    kv.free("a")
    # Pressure evicts a's pages; a new context [2 2][5 5] takes the freed hash of [5 5].
    assert kv.allocate_slots("filler", 2 * 3)
    kv.free("filler")
    admit(kv, "t", [2, 2, 5, 5, 0])
    hit = kv.probe_prefix([2, 2, 5, 5, 7, 7, 3])
    # r's third page holds K/V of [1 1 5 5 7 7]: reusing it for [2 2 5 5 7 7] would be wrong.
    for space in range(len(kv.pools)):
        assert kv.block_table("r", space)[2] not in hit.pages[space]
    assert hit.num_tokens <= 4


def test_lru_eviction_takes_unreferenced_cached_pages_under_pressure():
    kv = make_manager("unified", num_pages=6)
    admit(kv, "old", [1, 2, 3, 4, 5])               # 3 pages
    kv.free("old")
    admit(kv, "new", [6, 7, 8, 9, 0])               # 3 pages: the free ones, no eviction
    kv.free("new")
    assert kv.probe_prefix([1, 2, 3, 4, 0]).num_tokens == 4
    assert kv.probe_prefix([6, 7, 8, 9, 0]).num_tokens == 4
    assert kv.pages_in_use() == 0 and kv.num_available() == 6
    # Three pages: the two free ones, then the least recently freed cached page: old's tail, not its head.
    assert kv.allocate_slots("x", 6)
    assert kv.probe_prefix([1, 2, 3, 4, 0]).num_tokens == 2
    assert kv.probe_prefix([6, 7, 8, 9, 0]).num_tokens == 4
    # Reusing new's pages pins them; the one page left to take is old's head.
    hit = kv.probe_prefix([6, 7, 8, 9, 0])
    assert kv.allocate_slots("y", 5, hit)
    assert kv.probe_prefix([1, 2, 3, 4, 0]).num_tokens == 0
    assert kv.block_table("y")[:2] == hit.pages[0]
    # Cached pages a request holds are never evicted.
    assert kv.num_available() == 0
    assert not kv.allocate_slots("z", 1)
    assert kv.probe_prefix([6, 7, 8, 9, 0]).pages == hit.pages


def test_a_hit_on_evictable_pages_counts_them_against_the_budget():
    kv = make_manager("unified", num_pages=4)
    admit(kv, "a", [1, 2, 3, 4, 5])                 # 3 pages, 2 of them cached
    kv.free("a")
    hit = kv.probe_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert hit.num_tokens == 4
    # 5 pages needed: 2 shared (they leave the evictable set) + 3 new > 4 available.
    assert not kv.allocate_slots("b", 9, hit)
    assert kv.pages_in_use() == 0 and not kv.has_request("b")
    assert kv.allocate_slots("b", 8, hit)
    assert kv.block_table("b")[:2] == hit.pages[0] and kv.pages_in_use() == 4


# --- draft layers: optional for reuse -----------------------------------------------------------

def test_a_page_with_incomplete_draft_layers_is_not_reused_until_completed():
    kv = make_manager("unified", drafter_in_use=True)
    tokens = [1, 2, 3, 4, 5, 6, 7]
    hit = kv.probe_prefix(tokens)
    assert kv.allocate_slots("a", 7, hit)
    kv.commit("a", tokens, 7, num_draft_tokens=3)   # draft K/V of page [3 4] not all written
    assert kv.probe_prefix(tokens).num_tokens == 2
    kv.commit("a", tokens, 7, num_draft_tokens=5)
    assert kv.probe_prefix(tokens).num_tokens == 4
    kv.commit("a", tokens, 7, num_draft_tokens=7)
    assert kv.probe_prefix(tokens).num_tokens == 6
    assert kv.probe_prefix(tokens).pages[0] == kv.block_table("a")[:3]


def test_without_the_drafter_target_layers_decide_alone():
    kv = make_manager("unified", drafter_in_use=False)
    admit(kv, "a", [1, 2, 3, 4, 5], num_draft=0)
    assert kv.probe_prefix([1, 2, 3, 4, 5]).num_tokens == 4


def test_without_draft_layers_target_layers_decide_alone():
    kv = make_manager("target_only", drafter_in_use=True)
    admit(kv, "a", [1, 2, 3, 4, 5], num_draft=0)
    assert kv.probe_prefix([1, 2, 3, 4, 5]).num_tokens == 4


def test_separate_layout_reuses_only_where_the_draft_space_also_hits():
    kv = make_manager("separate", drafter_in_use=True)
    tokens = [1, 2, 3, 4, 5, 6, 7]
    assert kv.allocate_slots("a", 7, kv.probe_prefix(tokens))
    kv.commit("a", tokens, 7, num_draft_tokens=2)
    hit = kv.probe_prefix(tokens)
    assert hit.num_tokens == 2
    assert hit.pages == [kv.block_table("a", 0)[:1], kv.block_table("a", 1)[:1]]
    kv.commit("a", tokens, 7, num_draft_tokens=7)
    hit = kv.probe_prefix(tokens)
    assert hit.num_tokens == 6
    assert hit.pages == [kv.block_table("a", 0)[:3], kv.block_table("a", 1)[:3]]
    # Draft pages evicted while the target ones survive: no hit, the draft context would be missing.
    kv.free("a")
    assert kv.allocators[1].allocate(kv.allocators[1].num_available)
    assert kv.probe_prefix(tokens).num_tokens == 0


# --- lookahead, all-or-nothing allocation, fork -------------------------------------------------

@pytest.mark.parametrize("layout", ["unified", "separate"])
def test_every_allocation_reserves_the_lookahead(layout):
    kv = make_manager(layout, lookahead_tokens=3)
    assert kv.pages_needed(4) == 4              # 4 + 3 tokens on pages of 2
    assert kv.allocate_slots("a", 4)            # a prompt ending on a page boundary
    assert [len(kv.block_table("a", s)) for s in range(len(kv.pools))] == [4] * len(kv.pools)
    for num_tokens in range(5, 12):             # every decode step keeps the lookahead ahead
        assert kv.allocate_slots("a", num_tokens)
        assert all(len(kv.block_table("a", s)) == -(-(num_tokens + 3) // PS) for s in range(len(kv.pools)))
    no_lookahead = make_manager(layout)
    assert no_lookahead.allocate_slots("a", 4) and len(no_lookahead.block_table("a")) == 2
    one = make_manager(layout, lookahead_tokens=1)
    assert one.allocate_slots("a", 4) and len(one.block_table("a")) == 3


def test_a_prefix_hit_allocation_reserves_the_lookahead_too():
    kv = make_manager("unified", lookahead_tokens=2)
    admit(kv, "a", [1, 2, 3, 4, 5])
    hit = kv.probe_prefix([1, 2, 3, 4, 5, 6])
    assert hit.num_tokens == 4
    assert kv.allocate_slots("b", 6, hit)
    assert len(kv.block_table("b")) == kv.pages_needed(6) == 4


@pytest.mark.parametrize("layout", ["unified", "separate"])
def test_allocate_slots_changes_nothing_when_pages_run_out(layout):
    # The separate layout's draft space is the tighter one: it must veto the target space too.
    kv = make_manager(layout, num_pages=8, draft_pages=5, lookahead_tokens=1)
    admit(kv, "a", [1, 2, 3, 4, 5])
    before = snapshot(kv, ["a", "b"])
    limit = 10 if layout == "separate" else 16
    assert not kv.allocate_slots("a", limit)
    assert not kv.allocate_slots("b", limit - 4 + 2 * 3, kv.probe_prefix([1, 2, 3, 4, 5, 6]))
    assert snapshot(kv, ["a", "b"]) == before and not kv.has_request("b")
    assert kv.allocate_slots("a", limit - 2)
    with pytest.raises(ValueError):
        kv.allocate_slots("a", 12, kv.probe_prefix([1, 2, 3, 4, 5]))    # a hit only applies at admission


@pytest.mark.parametrize("layout", ["unified", "separate"])
@pytest.mark.parametrize("num_tokens", [4, 5])
def test_fork_shares_full_pages_and_copies_the_partial_one(layout, num_tokens):
    kv = make_manager(layout, lookahead_tokens=3)
    assert kv.allocate_slots("p", num_tokens)
    used = kv.pages_in_use()
    copies = kv.fork("p", "c", num_tokens)
    full = num_tokens // PS
    for space in range(len(kv.pools)):
        p, c = kv.block_table("p", space), kv.block_table("c", space)
        assert c[:full] == p[:full] and not set(c[full:]) & set(p)
        assert len(c) == kv.pages_needed(num_tokens)
        assert copies[space] == ([(p[full], c[full])] if num_tokens % PS else [])
    assert kv.pages_in_use() == used + len(kv.pools) * (kv.pages_needed(num_tokens) - full)
    with pytest.raises(ValueError):
        kv.fork("p", "c", num_tokens)
    kv.free("p")
    kv.free("c")
    assert kv.pages_in_use() == 0


def test_fork_that_does_not_fit_changes_nothing():
    kv = make_manager("unified", num_pages=5, lookahead_tokens=3)
    assert kv.allocate_slots("p", 5)              # 4 pages
    before = snapshot(kv, ["p", "c"])
    with pytest.raises(MemoryError):
        kv.fork("p", "c", 5)                       # needs 2 fresh pages, 1 left
    assert snapshot(kv, ["p", "c"]) == before and not kv.has_request("c")


def test_a_forked_child_commits_and_frees_without_touching_the_parent():
    kv = make_manager("unified")
    tokens = [1, 2, 3, 4, 5]
    admit(kv, "p", tokens)
    kv.fork("p", "c", 5)
    kv.allocate_slots("c", 7)
    kv.commit("c", tokens + [8, 9], 7)
    assert kv.probe_prefix(tokens + [8, 9, 0]).pages[0] == kv.block_table("c")[:3]
    kv.free("c")
    assert kv.pages_in_use() == len(kv.block_table("p"))
    kv.free("p")
    assert kv.pages_in_use() == 0


def test_manager_refuses_mismatched_page_sizes():
    with pytest.raises(ValueError):
        KVCacheManager([KVPool(target_specs(), 2, 4), KVPool(draft_specs(), 4, 4)])
    assert isinstance(make_manager("unified").probe_prefix([1]), PrefixHit)


def runs(pages):
    return sum(1 for i, p in enumerate(pages) if i == 0 or p != pages[i - 1] + 1)


def test_a_request_pages_come_in_runs_one_per_chunk_at_worst():
    """A transfer moves one region per run of pages and pool group (one READ descriptor each): a request grows
    right after its last page where that is free, and a prompt takes the smallest free run that holds it."""
    kv = make_manager("unified", num_pages=64, enable_prefix_caching=False)
    for step in range(1, 5):                     # one request's chunks of 4 pages: one run
        assert kv.allocate_slots("a", step * 4 * PS)
    assert runs(kv.block_table("a", 0)) == 1
    for step in range(1, 5):                     # two requests' chunks interleaved: a run per chunk at worst
        assert kv.allocate_slots("b", step * 4 * PS)
        assert kv.allocate_slots("c", step * 4 * PS)
    assert runs(kv.block_table("b", 0)) <= 4 and runs(kv.block_table("c", 0)) <= 4
    kv.free("a")
    assert kv.allocate_slots("d", 10 * PS)       # a 10-page prompt at once: into the 16-page hole "a" left
    assert kv.block_table("d", 0) == list(range(0, 10))
    assert kv.allocate_slots("d", 12 * PS)       # and it grows in place
    assert runs(kv.block_table("d", 0)) == 1


@pytest.mark.parametrize("host_tokens", [0, 10_000], ids=["device-positions", "host-positions"])
@pytest.mark.parametrize("layout", ["unified", "separate"])
def test_device_block_tables_follow_every_change_and_give_the_metadata_of_the_lists(layout, host_tokens, monkeypatch):
    """A step's metadata comes from the device copy of the block tables, which is only updated incrementally
    (pages a request gained, rows of freed requests reused, the tensor grown past its first size). Over a random
    history of admissions, growth, forks and frees, it must equal what the host's lists say, with positions and
    slots computed on the device (long steps) or on the host (short ones)."""
    import random

    from engine import model_runner
    from engine.model_runner import Row, build_metadata

    monkeypatch.setattr(model_runner, "HOST_METADATA_MAX_TOKENS", host_tokens)

    rng = random.Random(7)
    kv = make_manager(layout, num_pages=64, lookahead_tokens=1)
    for space in range(len(kv.pools)):
        kv.device_block_tables(space, torch.device("cpu"), rows=2, pages=2)     # small: it must grow
    lengths: dict[str, int] = {}
    for step in range(300):
        op = rng.random()
        live = sorted(lengths)
        if op < 0.3 or not live:
            rid = f"r{step}"
            tokens = [rng.randrange(5) for _ in range(rng.randrange(1, 12))]
            if kv.allocate_slots(rid, len(tokens), kv.probe_prefix(tokens)):
                kv.commit(rid, tokens, len(tokens))
                lengths[rid] = len(tokens)
        elif op < 0.65:
            rid = rng.choice(live)
            if kv.allocate_slots(rid, lengths[rid] + 3):
                lengths[rid] += 3
        elif op < 0.75:
            parent, child = rng.choice(live), f"f{step}"
            if kv.num_available() > 8:
                kv.fork(parent, child, lengths[parent])
                lengths[child] = lengths[parent]
        else:
            rid = rng.choice(live)
            kv.free(rid)
            del lengths[rid]
        live = sorted(lengths)
        if not live:
            continue
        batch = rng.sample(live, rng.randint(1, len(live)))
        rows = [Row(r, s, lengths[r] - s) for r in batch for s in [rng.randrange(lengths[r])]]
        for space in range(len(kv.pools)):
            positions, meta = build_metadata(kv, space, rows, causal=True, backend="torch", device=torch.device("cpu"))
            tables = [kv.block_table(r.request_id, space) for r in rows]
            width = max(map(len, tables))
            want_positions = [p for r in rows for p in range(r.start, r.start + r.num_tokens)]
            owners = [t for r, t in zip(rows, tables) for _ in range(r.num_tokens)]
            assert positions.tolist() == want_positions
            assert meta.slot_mapping.tolist() == [t[p // PS] * PS + p % PS for t, p in zip(owners, want_positions)]
            assert meta.block_tables.tolist() == [t + [0] * (width - len(t)) for t in tables]    # unused: 0
            assert meta.block_tables.shape == (len(rows), width)
            assert (positions.dtype, meta.slot_mapping.dtype, meta.block_tables.dtype, meta.seq_lens.dtype,
                    meta.query_start_loc.dtype) == (torch.int64, torch.int64, torch.int32, torch.int32, torch.int32)
            assert meta.seq_lens.tolist() == [r.start + r.num_tokens for r in rows]
            assert meta.query_start_loc.tolist() == [0] + list(itertools.accumulate(r.num_tokens for r in rows))
    mirrors = [kv.device_block_tables(space, torch.device("cpu")) for space in range(len(kv.pools))]
    assert all(m.table.shape[0] > 2 and m.table.shape[1] > 2 for m in mirrors)        # it grew
    for rid in list(lengths):
        kv.free(rid)
    assert all(len(m) == 0 for m in mirrors)        # every row given back with its request's pages


@pytest.mark.parametrize("grown_in_inference_mode", [True, False])
def test_device_block_tables_take_updates_in_and_out_of_inference_mode(grown_in_inference_mode):
    """The engine updates its device block tables from code under torch.inference_mode (graph replays, drafting)
    and from code outside it. A table that grew inside it became an inference tensor, and the next update from
    outside failed the whole step ("Inplace update to inference tensor outside InferenceMode"): a prefill replica
    holding more requests than its table's rows did that under load on the H200."""
    import contextlib

    from kv.device_tables import DeviceBlockTables

    mirror = DeviceBlockTables(torch.device("cpu"), rows=2, pages=2)
    mode = torch.inference_mode() if grown_in_inference_mode else contextlib.nullcontext()
    with mode:       # three requests in two rows, one of three pages in two columns: it grows both ways
        rows = mirror.rows(["a", "b", "c"], [[1], [2, 3, 4], [5]])
    with torch.inference_mode():
        rows += mirror.rows(["d"], [[6, 7]])
    shape = mirror.table.shape
    rows += mirror.rows(["a", "d"], [[1, 8], [6, 7, 9]])      # outside it, into the rows it has (no growth)
    assert mirror.table.shape == shape and not mirror.table.is_inference()
    table = mirror.table
    assert table[rows[0], :2].tolist() == [1, 8] and table[rows[1], :3].tolist() == [2, 3, 4]
    assert table[rows[2], :1].tolist() == [5] and table[rows[3], :3].tolist() == [6, 7, 9]
    assert rows[4:] == [rows[0], rows[3]] and len(set(rows[:4])) == 4
