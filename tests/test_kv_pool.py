"""KVPool: groups by page byte size, per-layer dtype views, byte locations, transfer regions, page copies."""

import pytest
import torch

from kv.pool import KVPool
from kv.spec import KVLayerSpec, LayerOwner, make_layer_specs, parse_dtype

T, D = LayerOwner.TARGET, LayerOwner.DRAFT
FP8, BF16, F32 = torch.float8_e4m3fn, torch.bfloat16, torch.float32
PAGE_SIZE, NUM_PAGES = 4, 5


def fp8_target_bf16_draft_same_size():
    # FP8 with 4 heads x 16 and BF16 with 2 heads x 16 both take 128 bytes a token: one group.
    return make_layer_specs(T, 2, FP8, 4, 16) + make_layer_specs(D, 2, BF16, 2, 16)


def fp8_target_bf16_draft_two_sizes():
    # FP8 2 x 16 (64 B/token) and BF16 2 x 16 (128 B/token): two groups.
    return make_layer_specs(T, 3, FP8, 2, 16) + make_layer_specs(D, 1, BF16, 2, 16)


def bf16_bf16():
    return make_layer_specs(T, 2, BF16, 2, 8) + make_layer_specs(D, 1, BF16, 2, 8)


def float32_mixed():
    return make_layer_specs(T, 2, F32, 2, 8) + make_layer_specs(D, 2, BF16, 1, 8)


ALL_LAYOUTS = [fp8_target_bf16_draft_same_size, fp8_target_bf16_draft_two_sizes, bf16_bf16, float32_mixed]


def make_pool(specs_fn, num_pages=NUM_PAGES):
    return KVPool(specs_fn(), PAGE_SIZE, num_pages)


def representable(dtype, value):
    """A tensor value exact in ``dtype`` (small integers are exact in every KV dtype, FP8 included)."""
    return torch.tensor(float(value)).to(dtype)


def fill_distinct(pool, pages, owners=(T, D)):
    """Write a value unique to (layer, K/V, page) into every element of those pages, through the views."""
    tag = 1
    for spec in pool.specs:
        if spec.owner not in owners:
            continue
        k, v = pool.kv_views(spec.owner, spec.layer_index)
        for page in pages:
            k[page] = representable(spec.dtype, tag)
            v[page] = representable(spec.dtype, -tag)
            tag += 1


def all_bytes(pool):
    return [group.buffer.clone() for group in pool.groups]


def test_spec_normalises_a_dtype_name():
    spec = KVLayerSpec(D, 0, "bf16", 2, 16)
    assert spec.dtype == BF16
    assert spec.element_size == 2
    assert spec.bytes_per_token() == 2 * 2 * 16 * 2
    assert parse_dtype("fp8") == FP8
    with pytest.raises(ValueError):
        parse_dtype("int8")


def test_groups_are_formed_by_page_byte_size():
    one = make_pool(fp8_target_bf16_draft_same_size)
    assert len(one.groups) == 1
    assert [s.name for s in one.groups[0].layers] == ["target.0", "target.1", "draft.0", "draft.1"]
    assert one.groups[0].page_bytes_per_layer == PAGE_SIZE * 128

    two = make_pool(fp8_target_bf16_draft_two_sizes)
    by_size = {g.page_bytes_per_layer: [s.name for s in g.layers] for g in two.groups}
    assert by_size == {PAGE_SIZE * 64: ["target.0", "target.1", "target.2"], PAGE_SIZE * 128: ["draft.0"]}
    assert two.bytes_per_page == PAGE_SIZE * (3 * 64 + 128)
    assert two.nbytes == NUM_PAGES * two.bytes_per_page == sum(g.buffer.numel() for g in two.groups)


@pytest.mark.parametrize("specs_fn", ALL_LAYOUTS)
def test_each_layer_view_keeps_its_own_dtype_and_element_size(specs_fn):
    pool = make_pool(specs_fn)
    for spec in pool.specs:
        k, v = pool.kv_views(spec.owner, spec.layer_index)
        for view in (k, v):
            assert view.dtype == spec.dtype
            assert view.element_size() == spec.element_size
            assert view.shape == (NUM_PAGES, PAGE_SIZE, spec.num_kv_heads, spec.head_dim)
        assert pool.location(spec.owner, spec.layer_index).kv_bytes == \
            PAGE_SIZE * spec.num_kv_heads * spec.head_dim * spec.element_size


def test_fp8_target_never_makes_draft_pages_one_byte():
    pool = make_pool(fp8_target_bf16_draft_same_size)
    assert pool.kv_views(T, 0)[0].element_size() == 1
    dk, dv = pool.kv_views(D, 1)
    assert dk.dtype == dv.dtype == BF16 and dk.element_size() == 2
    assert pool.location(D, 1).kv_bytes == PAGE_SIZE * 2 * 16 * 2
    # A BF16 value that FP8 cannot hold survives the round trip through the draft view.
    dk[2, 1, 0, 3] = 1.0078125
    assert dk[2, 1, 0, 3].item() == 1.0078125


@pytest.mark.parametrize("specs_fn", ALL_LAYOUTS)
def test_a_write_lands_at_the_location_byte_offset_and_nowhere_else(specs_fn):
    pool = make_pool(specs_fn)
    for spec in pool.specs:
        for which in (0, 1):                                      # K, then V
            for group in pool.groups:
                group.buffer.zero_()
            loc = pool.location(spec.owner, spec.layer_index)
            page, slot, head, dim = 3, 1, spec.num_kv_heads - 1, 1
            value = representable(spec.dtype, 3)
            pool.kv_views(spec.owner, spec.layer_index)[which][page, slot, head, dim] = value

            # Head-major inside a page: [kv head, token, head dim].
            element = (head * PAGE_SIZE + slot) * spec.head_dim + dim
            start = page * loc.page_stride + loc.offset_in_page + which * loc.kv_bytes + element * spec.element_size
            expected = value.reshape(1).view(torch.uint8)
            flat = pool.groups[loc.group].buffer.view(-1)
            assert torch.equal(flat[start:start + spec.element_size], expected)
            # Nothing else in any group changed: not other layers, not other pages, not the other half.
            touched = sum(int(g.buffer.count_nonzero()) for g in pool.groups)
            assert touched == int(expected.count_nonzero())


@pytest.mark.parametrize("specs_fn", ALL_LAYOUTS)
def test_filling_one_layer_page_leaves_other_layers_and_pages_untouched(specs_fn):
    pool = make_pool(specs_fn)
    fill_distinct(pool, range(NUM_PAGES))
    before = {s.name: [t.clone() for t in pool.kv_views(s.owner, s.layer_index)] for s in pool.specs}
    victim = pool.specs[-1]
    k, v = pool.kv_views(victim.owner, victim.layer_index)
    k[1] = representable(victim.dtype, 100)
    v[1] = representable(victim.dtype, 101)
    for spec in pool.specs:
        ks, vs = pool.kv_views(spec.owner, spec.layer_index)
        for page in range(NUM_PAGES):
            if spec.name == victim.name and page == 1:
                assert (ks[page] == representable(spec.dtype, 100)).all()
                continue
            assert torch.equal(ks[page], before[spec.name][0][page]), (spec.name, page)
            assert torch.equal(vs[page], before[spec.name][1][page]), (spec.name, page)


@pytest.mark.parametrize("specs_fn", ALL_LAYOUTS)
@pytest.mark.parametrize("owners", [(T, D), (T,), (D,)], ids=["both", "target", "draft"])
def test_page_regions_cover_exactly_the_chosen_layers_and_pages(specs_fn, owners):
    src = make_pool(specs_fn)
    pages = [3, 0]
    fill_distinct(src, range(NUM_PAGES))
    regions = src.page_regions(pages, owners)

    expected_bytes = len(pages) * sum(s.page_bytes(PAGE_SIZE) for s in src.specs if s.owner in owners)
    assert sum(length for _, _, length in regions) == expected_bytes
    # Simulate the transfer: move each region's bytes into an empty pool with the same layout.
    dst = make_pool(specs_fn)
    for group, offset, length in regions:
        src_flat, dst_flat = src.groups[group].buffer.view(-1), dst.groups[group].buffer.view(-1)
        assert offset + length <= src_flat.numel()
        dst_flat[offset:offset + length] = src_flat[offset:offset + length]
    for spec in src.specs:
        for half in (0, 1):
            moved = dst.kv_views(spec.owner, spec.layer_index)[half]
            original = src.kv_views(spec.owner, spec.layer_index)[half]
            for page in range(NUM_PAGES):
                if spec.owner in owners and page in pages:
                    assert torch.equal(moved[page], original[page]), (spec.name, half, page)
                else:
                    assert not moved[page].view(torch.uint8).any(), (spec.name, half, page)


def test_both_owners_give_one_region_per_page_per_group():
    pool = make_pool(fp8_target_bf16_draft_two_sizes)
    regions = pool.page_regions([2])
    assert sorted(g for g, _, _ in regions) == [0, 1]
    for group, offset, length in regions:
        assert offset == 2 * pool.groups[group].page_stride
        assert length == pool.groups[group].page_stride
    # Target only skips the draft-only group altogether.
    assert [g for g, _, _ in pool.page_regions([2], (T,))] == [pool.location(T, 0).group]


@pytest.mark.parametrize("specs_fn", ALL_LAYOUTS)
def test_copy_pages_copies_every_layer_and_only_the_destination(specs_fn):
    pool = make_pool(specs_fn)
    fill_distinct(pool, [1, 2])
    before = all_bytes(pool)
    pool.copy_pages([(1, 4), (2, 0)])
    for spec in pool.specs:
        for half in pool.kv_views(spec.owner, spec.layer_index):
            assert torch.equal(half[4], half[1]) and half[4].view(torch.uint8).any()
            assert torch.equal(half[0], half[2]) and half[0].view(torch.uint8).any()
    for group, old in zip(pool.groups, before):
        for page in (1, 2, 3):
            assert torch.equal(group.buffer[page], old[page])


def test_custom_buffer_allocator_backs_the_views():
    backing = []

    def allocate(n):
        backing.append(torch.zeros(n, dtype=torch.uint8))
        return backing[-1]

    pool = KVPool(fp8_target_bf16_draft_two_sizes(), PAGE_SIZE, NUM_PAGES, allocate=allocate)
    assert len(backing) == len(pool.groups)
    pool.kv_views(D, 0)[0][0] = 1.0
    assert any(b.any() for b in backing)
    with pytest.raises(ValueError):
        KVPool(bf16_bf16(), PAGE_SIZE, NUM_PAGES, allocate=lambda n: torch.zeros(n + 1, dtype=torch.uint8))


def test_duplicate_layers_are_refused():
    with pytest.raises(ValueError):
        KVPool(make_layer_specs(T, 1, BF16, 1, 8) * 2, PAGE_SIZE, NUM_PAGES)



def test_one_kv_heads_tokens_of_a_page_are_one_contiguous_run():
    """What lets a peer of another TP size READ a slice of heads as one fragment per page, layer and K/V."""
    pool = make_pool(ALL_LAYOUTS[0])
    spec = pool.specs[0]
    loc = pool.location(spec.owner, spec.layer_index)
    page, head = 2, spec.num_kv_heads - 1
    run = PAGE_SIZE * spec.head_dim * spec.element_size
    value = representable(spec.dtype, 2)
    for which, view in enumerate(pool.kv_views(spec.owner, spec.layer_index)):
        for g in pool.groups:
            g.buffer.zero_()
        view[page, :, head] = value
        start = page * loc.page_stride + loc.offset_in_page + which * loc.kv_bytes + head * run
        expected = torch.zeros_like(pool.groups[loc.group].buffer.view(-1))
        expected[start:start + run] = value.reshape(1).view(torch.uint8).repeat(run // spec.element_size)
        assert torch.equal(pool.groups[loc.group].buffer.view(-1), expected)
        assert all(int(g.buffer.count_nonzero()) == 0 for n, g in enumerate(pool.groups) if n != loc.group)
