"""Paged attention: torch reference vs a dense computation, Triton vs the reference, and the fp8 cache's error."""

import os


def _has_cuda_device() -> bool:
    gpus = "/proc/driver/nvidia/gpus"
    return os.path.exists("/dev/nvidia0") or (os.path.isdir(gpus) and bool(os.listdir(gpus)))


# Without a GPU the Triton kernels run in the interpreter; it must be chosen before any kernel is defined.
if not _has_cuda_device():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses  # noqa: E402
import math  # noqa: E402
import threading  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from engine.attention import (  # noqa: E402
    FP8_DTYPE,
    AttentionMetadata,
    paged_attention,
    quantize_for_cache,
    store_kv,
)
from engine.cuda_graphs import capture_sizes  # noqa: E402

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
HEAD_DIM = 32
NUM_KV_HEADS = 2
# Ragged batches of (tokens already in the cache, query tokens this step). MIXED_BATCH: a fresh prefill, a
# prefill chunk after earlier context, two decodes, and a chunk that crosses page boundaries at every page size
# tested. DECODE_BATCH: lengths 1 (one key), a page plus one, past several tiles, and just under a page of 64.
MIXED_BATCH = [(0, 7), (37, 13), (70, 1), (120, 20), (3, 1)]
DECODE_BATCH = [(0, 1), (16, 1), (149, 1), (63, 1)]


# --------------------------------------------------------------------------------------------------- helpers


def make_layer_caches(num_pages, page_size, dtype, layers_in_group=3, layer=1, num_kv_heads=NUM_KV_HEADS,
                      head_dim=HEAD_DIM, seed=0, head_major=True):
    """K/V views [pages, page, H, D] of one layer inside a page-major group buffer filled with junk: head-major
    pages [pages, layers, 2, H, page, D] as ``kv.pool`` lays them out, or token-major [pages, layers, 2, page, H, D]."""
    gen = torch.Generator().manual_seed(seed)
    inner = (num_kv_heads, page_size) if head_major else (page_size, num_kv_heads)
    group = (torch.randn((num_pages, layers_in_group, 2, *inner, head_dim), generator=gen) * 3).to(dtype).to(DEVICE)
    return group, *layer_views(group, layer, head_major)


def layer_views(group, layer, head_major=True):
    """The [pages, page, H, D] K and V views of ``layer`` in a group buffer of ``make_layer_caches``."""
    return tuple(group[:, layer, i].transpose(1, 2) if head_major else group[:, layer, i] for i in (0, 1))


def build_batch(spec, page_size, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, seed=0, spare_pages=5):
    """Dense float32 K/V per sequence, shuffled page ids, and metadata for a batch of (context, query) lengths."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [ctx + q for ctx, q in spec]
    pages_per_seq = [math.ceil(n / page_size) for n in seq_lens]
    num_pages = sum(pages_per_seq) + spare_pages
    page_ids = torch.randperm(num_pages, generator=gen)
    max_pages = max(pages_per_seq) + 1
    block_tables = torch.full((len(spec), max_pages), -1, dtype=torch.int32)
    block_tables[1::2] = 0  # unused entries may be 0 as well as -1
    used = 0
    for b, n in enumerate(pages_per_seq):
        block_tables[b, :n] = page_ids[used:used + n]
        used += n
    q_lens = [q for _, q in spec]
    query_start_loc = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    slots = []
    for b, (ctx, q) in enumerate(spec):
        for pos in range(ctx, ctx + q):
            slots.append(int(block_tables[b, pos // page_size]) * page_size + pos % page_size)
    dense_k = [torch.randn(n, num_kv_heads, head_dim, generator=gen) for n in seq_lens]
    dense_v = [torch.randn(n, num_kv_heads, head_dim, generator=gen) for n in seq_lens]
    meta = AttentionMetadata(
        query_start_loc=query_start_loc.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=block_tables.to(DEVICE),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
    )
    return meta, dense_k, dense_v, num_pages


def write_dense(cache, dense, meta, scale=1.0):
    """Put each sequence's dense rows into its pages position by position (independently of store_kv)."""
    page_size = cache.shape[1]
    for b, rows in enumerate(dense):
        for pos in range(rows.shape[0]):
            page = int(meta.block_tables[b, pos // page_size])
            cache[page, pos % page_size] = quantize_for_cache(rows[pos].to(DEVICE), cache.dtype, scale)


def dense_attention(query, dense_k, dense_v, meta, scale):
    """Float64 attention per sequence and query head over contiguous K/V with an explicit visibility mask."""
    num_q_heads = query.shape[1]
    group = num_q_heads // dense_k[0].shape[1]
    out = torch.zeros(query.shape, dtype=torch.float64)
    starts = meta.query_start_loc.tolist()
    for b, (k, v) in enumerate(zip(dense_k, dense_v)):
        seq_len = k.shape[0]
        q_len = starts[b + 1] - starts[b]
        for i in range(q_len):
            position = seq_len - q_len + i
            visible = torch.arange(seq_len) <= position if meta.causal else torch.ones(seq_len, dtype=torch.bool)
            for h in range(num_q_heads):
                kv_head = h // group  # GQA: consecutive query heads share a kv head
                logits = k[:, kv_head].double() @ query[starts[b] + i, h].double() * scale
                probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=0)
                out[starts[b] + i, h] = probs @ v[:, kv_head].double()
    return out


def rel_err(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm()).item()


def make_query(meta, num_q_heads, dtype, seed=1, head_dim=HEAD_DIM):
    """Queries as a strided view (the q slice of a fused qkv projection), not a contiguous tensor."""
    gen = torch.Generator().manual_seed(seed)
    num_tokens = int(meta.query_start_loc[-1])
    qkv = torch.randn(num_tokens, num_q_heads + 2 * NUM_KV_HEADS, head_dim, generator=gen).to(dtype).to(DEVICE)
    return qkv[:, :num_q_heads]


def run(backend, query, k_cache, v_cache, meta, scale, **kw):
    meta.backend = backend
    return paged_attention(query, k_cache, v_cache, meta, scale, **kw)


# ----------------------------------------------------------------------------------------- torch reference


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("head_major", [True, False])
def test_reference_matches_dense_attention(page_size, causal, head_major):
    meta, dense_k, dense_v, num_pages = build_batch(MIXED_BATCH, page_size)
    meta.causal = causal
    _, k_cache, v_cache = make_layer_caches(num_pages, page_size, torch.float32, head_major=head_major)
    write_dense(k_cache, dense_k, meta)
    write_dense(v_cache, dense_v, meta)
    query = make_query(meta, num_q_heads=6, dtype=torch.float32)  # GQA group of 3
    out = run("torch", query, k_cache, v_cache, meta, scale=0.3)
    torch.testing.assert_close(out.double().cpu(), dense_attention(query.cpu(), dense_k, dense_v, meta, 0.3),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_major", [True, False])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, FP8_DTYPE])
def test_store_kv_writes_mapped_slots_only(cache_dtype, head_major):
    page_size, scale = 16, 0.37
    meta, _, _, num_pages = build_batch(MIXED_BATCH, page_size)
    group, k_cache, v_cache = make_layer_caches(num_pages, page_size, cache_dtype, head_major=head_major)
    before = group.clone()
    gen = torch.Generator().manual_seed(3)
    num_tokens = meta.slot_mapping.shape[0]
    key = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(DEVICE)
    value = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(DEVICE)
    slots = meta.slot_mapping.clone()
    slots[::4] = -1
    store_kv(key, value, k_cache, v_cache, slots, k_scale=scale, v_scale=scale)

    expected = before.clone()
    k_expected, v_expected = layer_views(expected, 1, head_major)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            k_expected[slot // page_size, slot % page_size] = quantize_for_cache(key[t], cache_dtype, scale)
            v_expected[slot // page_size, slot % page_size] = quantize_for_cache(value[t], cache_dtype, scale)
    # Bitwise over the whole group buffer: other layers, skipped slots and unused pages keep their junk.
    assert torch.equal(group.view(torch.uint8), expected.view(torch.uint8))
    if cache_dtype == FP8_DTYPE:
        t = next(t for t, s in enumerate(slots.tolist()) if s >= 0)
        s = int(slots[t])
        loaded = k_cache[s // page_size, s % page_size].float() * scale
        assert rel_err(loaded, key[t]) < 0.05  # dequantized fp8 is close to the input, so the scale was applied


def test_unknown_backend_is_refused():
    meta, _, _, num_pages = build_batch([(0, 2)], 16)
    _, k_cache, v_cache = make_layer_caches(num_pages, 16, torch.float32)
    with pytest.raises(ValueError, match="cuda_graphs"):
        run("cuda_graphs", make_query(meta, 2, torch.float32), k_cache, v_cache, meta, 1.0)


# -------------------------------------------------------------------------------------------- fp8 accuracy


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.triton)])
def test_fp8_cache_error_is_bounded(backend):
    """FP8 (e4m3, per-layer scale = amax / 448) cache vs bf16 cache, both against attention on exact K/V.

    e4m3 keeps 3 mantissa bits: each element's relative rounding error is at most 2**-4 = 6.25% and about
    2.5% RMS on Gaussian data. Output errors from V average out no better than that, and K's errors only
    perturb the softmax weights, so on unit-Gaussian data the output's relative L2 error stays near 3%: we
    require < 5%. bf16 (8 mantissa bits) must land under 0.5%, and fp8 must be clearly worse than bf16, so the
    test would notice a cache that silently stored bf16 or a scale that was ignored (both give >> 5% or ~0.3%).
    """
    page_size = 16
    meta, dense_k, dense_v, num_pages = build_batch(MIXED_BATCH, page_size, seed=7)
    query = make_query(meta, num_q_heads=4, dtype=torch.bfloat16)
    scale = HEAD_DIM ** -0.5
    exact = dense_attention(query.float().cpu(), dense_k, dense_v, meta, scale)
    errors = {}
    for dtype in (torch.bfloat16, FP8_DTYPE):
        _, k_cache, v_cache = make_layer_caches(num_pages, page_size, dtype)
        k_scale = max(k.abs().max().item() for k in dense_k) / 448 if dtype == FP8_DTYPE else 1.0
        v_scale = max(v.abs().max().item() for v in dense_v) / 448 if dtype == FP8_DTYPE else 1.0
        write_dense(k_cache, dense_k, meta, k_scale)
        write_dense(v_cache, dense_v, meta, v_scale)
        out = run(backend, query, k_cache, v_cache, meta, scale, k_scale=k_scale, v_scale=v_scale)
        errors[dtype] = rel_err(out, exact)
    assert errors[torch.bfloat16] < 0.005, errors
    assert errors[FP8_DTYPE] < 0.05, errors
    assert errors[FP8_DTYPE] > 2 * errors[torch.bfloat16], errors


# --------------------------------------------------------------------------------------- triton vs torch


def fp8_midpoints():
    """Every value exactly halfway between two adjacent positive e4m3 values: the ties rounding must break."""
    codes = torch.arange(0, 0x7F, dtype=torch.uint8).view(FP8_DTYPE).float()  # 0x7F is NaN
    return (codes[1:] + codes[:-1]) / 2


@pytest.mark.triton
@pytest.mark.parametrize("cache_dtype,key_dtype,scale", [
    (torch.float32, torch.float32, 1.0),
    (torch.bfloat16, torch.bfloat16, 1.0),
    (torch.bfloat16, torch.float32, 1.0),  # downcast must round to nearest even, like torch
    (torch.float16, torch.float16, 1.0),
    (FP8_DTYPE, torch.bfloat16, 0.37),
    (FP8_DTYPE, torch.float32, 2.0),  # power-of-two scale: the midpoints below stay exact ties after division
])
def test_triton_store_kv_matches_torch(cache_dtype, key_dtype, scale):
    page_size = 16
    meta, _, _, num_pages = build_batch(MIXED_BATCH, page_size)
    gen = torch.Generator().manual_seed(5)
    num_tokens = meta.slot_mapping.shape[0]
    # Strided views (slices of a fused kv projection), magnitudes that reach fp8 saturation and subnormals.
    kv = torch.randn(num_tokens, 2, NUM_KV_HEADS, HEAD_DIM, generator=gen) * scale
    kv *= torch.logspace(-4, 3, HEAD_DIM).view(1, 1, 1, -1)[..., torch.randperm(HEAD_DIM, generator=gen)]
    ties = fp8_midpoints() * scale
    flat = kv[:, 0].reshape(-1)
    flat[: ties.numel()] = ties
    flat[ties.numel(): 2 * ties.numel()] = -ties
    kv[:, 0] = flat.view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    kv = kv.to(key_dtype).to(DEVICE)
    key, value = kv[:, 0], kv[:, 1]
    slots = meta.slot_mapping.clone()
    slots[1::3] = -1

    results = {}
    for backend in ("torch", "triton"):
        group, k_cache, v_cache = make_layer_caches(num_pages, page_size, cache_dtype)
        store_kv(key, value, k_cache, v_cache, slots, k_scale=scale, v_scale=scale, backend=backend)
        results[backend] = group
    untouched = make_layer_caches(num_pages, page_size, cache_dtype)[0]
    skipped = meta.slot_mapping[1::3]
    for stored, before in zip(layer_views(results["triton"], 1), layer_views(untouched, 1)):
        assert torch.equal(stored[skipped // page_size, skipped % page_size].view(torch.uint8),
                           before[skipped // page_size, skipped % page_size].view(torch.uint8))
    mismatched = (results["triton"].view(torch.uint8) != results["torch"].view(torch.uint8)).sum().item()
    assert mismatched == 0


# The interpreter's dots take bf16 tiles in fp32, so only rare one-ulp flips of the bf16 output remain; a GPU
# feeds bf16 probabilities to the tensor cores, whose rounding costs about 3e-3 relative.
LOW_PRECISION_TOL = 5e-4 if DEVICE == "cpu" else 1e-2
TRITON_DTYPES = [
    # (query dtype, cache dtype, kv scale, relative-L2 tolerance vs the torch path on the same cache)
    (torch.float32, torch.float32, 1.0, 1e-5),
    (torch.bfloat16, torch.bfloat16, 1.0, LOW_PRECISION_TOL),
    (torch.bfloat16, FP8_DTYPE, 0.02, LOW_PRECISION_TOL),
]


def _triton_case(query_dtype, cache_dtype, kv_scale, page_size, spec, num_q_heads=6, seed=0, head_dim=HEAD_DIM):
    meta, dense_k, dense_v, num_pages = build_batch(spec, page_size, head_dim=head_dim, seed=seed)
    _, k_cache, v_cache = make_layer_caches(num_pages, page_size, cache_dtype, head_dim=head_dim, seed=seed)
    write_dense(k_cache, dense_k, meta, kv_scale)
    write_dense(v_cache, dense_v, meta, kv_scale)
    query = make_query(meta, num_q_heads, query_dtype, seed=seed + 1, head_dim=head_dim)
    return meta, k_cache, v_cache, query


@pytest.mark.triton
@pytest.mark.parametrize("query_dtype,cache_dtype,kv_scale,tol", TRITON_DTYPES)
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("causal", [True, False])
def test_triton_varlen_attention_matches_torch(query_dtype, cache_dtype, kv_scale, tol, page_size, causal):
    meta, k_cache, v_cache, query = _triton_case(query_dtype, cache_dtype, kv_scale, page_size, MIXED_BATCH)
    meta.causal = causal
    kw = dict(k_scale=kv_scale, v_scale=kv_scale)
    ref = run("torch", query, k_cache, v_cache, meta, 0.2, **kw)
    out = run("triton", query, k_cache, v_cache, meta, 0.2, **kw)
    assert out.dtype == query.dtype and not out.isnan().any()
    assert rel_err(out, ref) < tol


@pytest.mark.triton
@pytest.mark.parametrize("page_size", [24, 64])
@pytest.mark.parametrize("kernel", ["varlen", "decode", "decode split"])
def test_tiles_find_their_slots_in_pages_of_any_size_and_stale_rows_never_reach_the_output(page_size, kernel):
    """A tile's rows find their slots from the tile's start (``_slot_offsets``): tiles of 16 positions in pages of
    64 (four tiles a page) and of 24 (neither size divides the other). Every page row no sequence holds is NaN,
    page 0 included: a tile's K rows past the sequence's end are read from page 0 unmasked, so their scores must be
    masked, and its V rows there must stay out of the product (a zero probability times NaN is NaN)."""
    from engine import triton_attention as ta

    meta, dense_k, dense_v, num_pages = build_batch(MIXED_BATCH if kernel == "varlen" else DECODE_BATCH, page_size)
    group, k_cache, v_cache = make_layer_caches(num_pages, page_size, torch.float32)
    group.fill_(float("nan"))
    write_dense(k_cache, dense_k, meta)
    write_dense(v_cache, dense_v, meta)
    query = make_query(meta, 6, torch.float32)
    if kernel == "varlen":
        out = ta.varlen_attention(query, k_cache, v_cache, meta, 0.2)
    else:
        out = ta.decode_attention(query, k_cache, v_cache, meta, 0.2, num_splits=4 if kernel == "decode split" else 1)
    assert not out.isnan().any()
    assert rel_err(out, dense_attention(query.cpu(), dense_k, dense_v, meta, 0.2)) < 1e-5


@pytest.mark.triton
@pytest.mark.parametrize("block_m,block_n", [(16, 16), (32, 32), (64, 16)])
def test_triton_varlen_tilings_agree(block_m, block_n):
    """Several query blocks per sequence (block_m 16 holds 5 tokens of a group of 3) and tiles spanning pages."""
    from engine.triton_attention import varlen_attention

    meta, k_cache, v_cache, query = _triton_case(torch.float32, torch.float32, 1.0, 16, MIXED_BATCH)
    ref = run("torch", query, k_cache, v_cache, meta, 0.2)
    out = varlen_attention(query, k_cache, v_cache, meta, 0.2, block_m=block_m, block_n=block_n)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.triton
@pytest.mark.parametrize("block_m", [16, 64])
def test_the_flat_varlen_grid_gives_every_row_the_same_numbers(block_m):
    """The flat grid (a CUDA graph of a ragged batch: programs from T and B only) finds each program's sequence and
    q block by search: bit-identical to the per-sequence grid, also with the graph's padding (rows with no query
    and no context, tokens past the last row, which stay unwritten)."""
    from engine.triton_attention import varlen_attention

    meta, k_cache, v_cache, query = _triton_case(torch.float32, torch.float32, 1.0, 16, MIXED_BATCH)
    per_seq = varlen_attention(query, k_cache, v_cache, meta, 0.2, block_m=block_m, flat_grid=False)
    flat = varlen_attention(query, k_cache, v_cache, meta, 0.2, block_m=block_m, flat_grid=True)
    assert torch.equal(flat, per_seq)
    tokens, extra = query.shape[0], 9
    padded_query = torch.cat([query, torch.randn(extra, *query.shape[1:], dtype=query.dtype, device=DEVICE)])
    padded = dataclasses.replace(
        meta, query_start_loc=torch.cat([meta.query_start_loc, meta.query_start_loc[-1:].repeat(3)]),
        seq_lens=torch.cat([meta.seq_lens, meta.seq_lens.new_zeros(3)]),
        block_tables=torch.cat([meta.block_tables, meta.block_tables[:3]]), max_query_len=tokens + extra)
    out = varlen_attention(padded_query, k_cache, v_cache, padded, 0.2, block_m=block_m, flat_grid=True)
    assert torch.equal(out[:tokens], per_seq)


@pytest.mark.triton
def test_a_ragged_batch_of_short_rows_computes_as_its_ragged_graph_does():
    """Short rows of several lengths (a prefix hit's last tokens beside decode and verification rows) would take the
    split-KV kernel or a small varlen tile by their max_query_len; marked ragged they take the largest varlen tile,
    as the ragged graph of the same rows does (its max_query_len is its padded token count, its extra rows empty):
    the same bits either way, and the torch path's values."""
    meta, k_cache, v_cache, query = _triton_case(torch.float32, torch.float32, 1.0, 16, [(20, 1), (33, 5), (9, 3)])
    ragged = dataclasses.replace(meta, uniform=False)
    eager = run("triton", query, k_cache, v_cache, ragged, 0.2)
    padded = dataclasses.replace(
        ragged, query_start_loc=torch.cat([meta.query_start_loc, meta.query_start_loc[-1:].repeat(5)]),
        seq_lens=torch.cat([meta.seq_lens, meta.seq_lens.new_zeros(5)]),
        block_tables=torch.cat([meta.block_tables, meta.block_tables[:1].repeat(5, 1)]), max_query_len=32)
    graph_like = run("triton", torch.cat([query, query.new_zeros(23, *query.shape[1:])]), k_cache, v_cache, padded,
                     0.2)
    assert torch.equal(graph_like[:9], eager)
    assert rel_err(eager, run("torch", query, k_cache, v_cache, meta, 0.2)) < 1e-5


@pytest.mark.triton
@pytest.mark.parametrize("query_dtype,cache_dtype,kv_scale,tol", TRITON_DTYPES)
@pytest.mark.parametrize("num_splits", [None, 1, 3, 20])
@pytest.mark.parametrize("num_q_heads", [2, 8])  # GQA groups of 1 and 4
def test_triton_decode_attention_matches_torch(query_dtype, cache_dtype, kv_scale, tol, num_splits, num_q_heads):
    """Split-KV decode: 20 splits leave the short sequences with empty splits that the merge must ignore."""
    from engine.triton_attention import decode_attention

    meta, k_cache, v_cache, query = _triton_case(query_dtype, cache_dtype, kv_scale, 16, DECODE_BATCH,
                                                 num_q_heads=num_q_heads)
    kw = dict(k_scale=kv_scale, v_scale=kv_scale)
    ref = run("torch", query, k_cache, v_cache, meta, 0.2, **kw)
    out = decode_attention(query, k_cache, v_cache, meta, 0.2, num_splits=num_splits, **kw)
    assert rel_err(out, ref) < tol


@pytest.mark.triton
@pytest.mark.parametrize("merge_in_kernel", [False, True])
def test_a_merge_of_more_splits_than_it_loads_at_once_takes_them_all(merge_in_kernel):
    """40 splits of one tile: the merge kernel takes their partials 16 at a time (REDUCE_BLOCK_S), the last split
    program 16 or 32 per row of a decode token's 4 heads (``merge_splits``), in three rounds or two, rescaling what
    it has summed when a later round holds a larger maximum; a short sequence beside it has one split and writes
    its own."""
    from engine import triton_attention as ta

    assert ta.REDUCE_BLOCK_S < 40 and ta.merge_splits(4, 40) < 40
    block_n = ta.decode_block_n(make_layer_caches(1, 16, torch.float32)[1])
    meta, k_cache, v_cache, query = _triton_case(torch.float32, torch.float32, 1.0, 16,
                                                 [(40 * block_n - 1, 1), (5, 1)], num_q_heads=8)
    out = ta.decode_attention(query, k_cache, v_cache, meta, 0.2, num_splits=40,
                              max_split_keys=40 * block_n, merge_in_kernel=merge_in_kernel)
    assert rel_err(out, run("torch", query, k_cache, v_cache, meta, 0.2)) < 1e-5


@pytest.mark.triton
@pytest.mark.parametrize("num_q_heads,causal,queries", [(2, True, 1), (8, False, 1), (8, True, 1), (8, True, 3)])
def test_decode_rows_merge_their_splits_in_the_last_program(num_q_heads, causal, queries, monkeypatch):
    """Decode rows (a query x the GQA group, within 16 rows: GQA groups of 1 and 4, and 3 causal queries of a group
    of 4, whose early rows see no key of the last splits) merge their splits in the split kernel's last program
    of each (seq, kv head): no merge kernel is launched, the output matches torch and the merge kernel's, and the
    counters are all zero again after the launch, so a second launch (a graph's replay, the next layer) merges
    too. A sequence with no query this step and short sequences of one split count nothing. Launches that may run
    at once (on another CUDA stream; under the interpreter, from another thread) get counters of their own."""
    from engine import triton_attention as ta

    reduces = []
    merge_kernel = ta._decode_reduce_kernel

    class Counting:
        def __getitem__(self, grid):
            reduces.append(grid)
            return merge_kernel[grid]

    monkeypatch.setattr(ta, "_decode_reduce_kernel", Counting())
    spec = [(ctx, queries if q else 0) for ctx, q in DECODE_BATCH + [(21, 0)]]
    meta, k_cache, v_cache, query = _triton_case(torch.float32, torch.float32, 1.0, 16, spec, num_q_heads=num_q_heads)
    meta.causal = causal
    ref = run("torch", query, k_cache, v_cache, meta, 0.2)
    assert ta.in_kernel_merge_rows(meta.max_query_len, num_q_heads // NUM_KV_HEADS, False) > 0
    counters = ta.merge_counters(query.device, 0)
    merged = [ta.decode_attention(query, k_cache, v_cache, meta, 0.2, num_splits=5) for _ in range(2)]
    assert reduces == [] and counters is ta.merge_counters(query.device, 0) and not counters.any()
    for out in merged:
        assert rel_err(out, ref) < 1e-5
    assert torch.equal(merged[0], merged[1])
    by_kernel = ta.decode_attention(query, k_cache, v_cache, meta, 0.2, num_splits=5, merge_in_kernel=False)
    assert len(reduces) == 1
    torch.testing.assert_close(merged[0], by_kernel, rtol=1e-6, atol=1e-6)
    if query.device.type == "cuda":
        with torch.cuda.stream(torch.cuda.Stream(query.device)):
            assert ta.merge_counters(query.device, 0) is not counters
    else:
        other = []
        thread = threading.Thread(target=lambda: other.append(ta.merge_counters(query.device, 0)))
        thread.start()
        thread.join()
        assert other[0] is not counters


def test_only_short_rows_are_merged_in_the_split_kernel():
    """The last program merges up to 16 rows (a decode token's group, a few tokens of a small group), a power of
    two of at least 2; longer blocks, one split (nothing to merge) and the setting off leave it to the merge
    kernel."""
    from engine.triton_attention import in_kernel_merge_rows as rows

    assert rows(1, 4, False) == 4 and rows(1, 1, False) == 2 and rows(3, 4, False) == 16 and rows(2, 8, False) == 16
    assert rows(5, 4, False) == 0 and rows(16, 4, False) == 0
    assert rows(1, 4, True) == 0 and rows(1, 4, False, enabled=False) == 0


@pytest.mark.triton
@pytest.mark.parametrize("query_dtype,cache_dtype,kv_scale,tol", TRITON_DTYPES)
@pytest.mark.parametrize("num_splits,page_size", [(1, 16), (3, 16), (20, 1)])
def test_triton_decode_with_page_ids_loaded_a_tile_ahead(query_dtype, cache_dtype, kv_scale, tol, num_splits,
                                                        page_size):
    """The prefetching loop (``prefetch_pages``): the tile after a split's last one is past its end (its page ids
    load masked), splits end mid-page and mid-tile, tiles span pages (page 1) or sit in one."""
    from engine.triton_attention import decode_attention

    meta, k_cache, v_cache, query = _triton_case(query_dtype, cache_dtype, kv_scale, page_size, DECODE_BATCH,
                                                 num_q_heads=8)
    kw = dict(k_scale=kv_scale, v_scale=kv_scale)
    ref = run("torch", query, k_cache, v_cache, meta, 0.2, **kw)
    out = decode_attention(query, k_cache, v_cache, meta, 0.2, num_splits=num_splits, prefetch_pages=True, **kw)
    assert rel_err(out, ref) < tol


# Verification-shaped rows (a history token plus drafts after a context), ragged, one without a query, one with a
# block longer than its context: with many splits a causal block's early tokens see no key of the last split.
BLOCK_BATCH = [(0, 16), (37, 5), (21, 0), (70, 16), (3, 1), (130, 9)]


@pytest.mark.triton
@pytest.mark.parametrize("query_dtype,cache_dtype,kv_scale,tol", TRITON_DTYPES)
@pytest.mark.parametrize("num_splits", [1, 3, 20])
@pytest.mark.parametrize("causal", [True, False])
def test_triton_split_kv_attention_of_short_blocks_matches_torch(query_dtype, cache_dtype, kv_scale, tol,
                                                                   num_splits, causal):
    """Blocks of up to 16 queries (verification is causal, drafter blocks are not) through the split-KV kernel,
    a GQA group of 4 (64 rows a program), with the prefetching loop too."""
    from engine.triton_attention import decode_attention

    meta, k_cache, v_cache, query = _triton_case(query_dtype, cache_dtype, kv_scale, 16, BLOCK_BATCH, num_q_heads=8)
    meta.causal = causal
    kw = dict(k_scale=kv_scale, v_scale=kv_scale)
    ref = run("torch", query, k_cache, v_cache, meta, 0.2, **kw)
    for prefetch in (False, True):
        out = decode_attention(query, k_cache, v_cache, meta, 0.2, num_splits=num_splits, prefetch_pages=prefetch,
                               **kw)
        assert not out[:int(meta.query_start_loc[-1])].isnan().any()
        assert rel_err(out, ref) < tol
    # A CUDA graph's padding row: 16 queries over a context of one token (its causal rows but the first see no
    # key). Its output is finite (a graph's capture compares all rows) and the other rows keep theirs.
    meta.seq_lens[0] = 1
    out = decode_attention(query, k_cache, v_cache, meta, 0.2, num_splits=num_splits, **kw)
    assert out[:16].isfinite().all()
    assert rel_err(out[16:], ref[16:]) < tol


@pytest.mark.triton
@pytest.mark.parametrize("num_splits,prefetch", [(1, False), (3, True)])
@pytest.mark.parametrize("causal", [True, False])
def test_triton_fp8_decode_widens_v_as_it_arrives_to_the_same_bits(num_splits, prefetch, causal):
    """FP8 V widened to fp16 as each tile arrives (``widen_v``, its masked rows zeroed after) gives the bits the
    kernel gives widening it at the product: single decode tokens and causal / non-causal short blocks, splits
    ending mid-tile, a row without a query."""
    from engine.triton_attention import decode_attention

    for spec in (DECODE_BATCH, BLOCK_BATCH):
        meta, k_cache, v_cache, query = _triton_case(torch.bfloat16, FP8_DTYPE, 0.02, 16, spec, num_q_heads=8)
        meta.causal = causal
        kw = dict(k_scale=0.02, v_scale=0.02, num_splits=num_splits, prefetch_pages=prefetch)
        at_product = decode_attention(query, k_cache, v_cache, meta, 0.2, widen_v=False, **kw)
        widened = decode_attention(query, k_cache, v_cache, meta, 0.2, widen_v=True, **kw)
        rows = int(meta.query_start_loc[-1])
        assert torch.equal(widened[:rows], at_product[:rows])
        ref = run("torch", query, k_cache, v_cache, meta, 0.2, k_scale=0.02, v_scale=0.02)
        assert rel_err(widened, ref) < LOW_PRECISION_TOL


@pytest.mark.triton
@pytest.mark.parametrize("batch,num_q_heads", [(DECODE_BATCH, 6), (BLOCK_BATCH, 8)])
def test_triton_dispatch_sends_short_blocks_to_split_kernel(monkeypatch, batch, num_q_heads):
    """Decode (one query a row) and, in a batch that leaves an H200's multiprocessors idle, verification blocks
    (16 queries x a group of 4 = 64 rows) take the split-KV kernel, whose result equals the varlen kernel's on the
    same batch; a longer block (17 x 4) goes to varlen."""
    from engine import triton_attention
    from engine.triton_attention import varlen_attention

    monkeypatch.setattr(triton_attention, "_multiprocessor_count", lambda device: 132)
    calls = []
    decode = triton_attention.decode_attention
    monkeypatch.setattr(triton_attention, "decode_attention", lambda *a, **kw: calls.append(1) or decode(*a, **kw))
    meta, k_cache, v_cache, query = _triton_case(torch.float32, torch.float32, 1.0, 16, batch,
                                                 num_q_heads=num_q_heads)
    via_dispatch = run("triton", query, k_cache, v_cache, meta, 0.2)
    assert calls == [1]
    via_varlen = varlen_attention(query, k_cache, v_cache, meta, 0.2)
    torch.testing.assert_close(via_dispatch, via_varlen, rtol=1e-5, atol=1e-5)
    ref = run("torch", query, k_cache, v_cache, meta, 0.2)
    assert rel_err(via_dispatch, ref) < 1e-5
    longer, k_cache, v_cache, query = _triton_case(torch.float32, torch.float32, 1.0, 16, [(5, 17)], num_q_heads=8)
    run("triton", query, k_cache, v_cache, longer, 0.2)
    assert calls == [1]


def test_blocks_of_more_than_16_rows_take_the_block_tiling(monkeypatch):
    """On a GPU, a split-KV program of a verification or drafter block (16 queries x a group of 4 = 64 rows) over an
    FP8 cache takes ``DECODE_BLOCK_TILING``'s tiles (64 keys, which ran 1.13-1.39x faster than the decode tiles on
    an H100), and a decode row's (16 rows) the decode tiling's; the kernel launch is recorded, not run (the
    interpreter's tiles are 16 keys whatever the rows)."""
    from engine import triton_attention as ta

    monkeypatch.setattr(ta, "INTERPRET", False)
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **constexprs: launches.append(constexprs)

    monkeypatch.setattr(ta, "_decode_split_kernel", Recorder())
    monkeypatch.setattr(ta, "_decode_reduce_kernel", Recorder())
    for spec, num_q_heads in ((BLOCK_BATCH, 8), (DECODE_BATCH, 8)):
        meta, k_cache, v_cache, query = _triton_case(torch.bfloat16, FP8_DTYPE, 0.02, 16, spec,
                                                     num_q_heads=num_q_heads)
        launches.clear()
        ta.decode_attention(query, k_cache, v_cache, meta, 0.2, k_scale=0.02, v_scale=0.02)
        rows = launches[0]["BLOCK_M"]
        tiling = ta.DECODE_BLOCK_TILING[1] if rows > 16 else ta.DECODE_TILING[1]
        assert (rows > 16) == (spec is BLOCK_BATCH)
        assert launches[0]["BLOCK_N"] == tiling.block_n
        assert launches[0]["PREFETCH_PAGES"] == tiling.prefetch_pages
        assert ta.DECODE_BLOCK_TILING[1].block_n != ta.DECODE_TILING[1].block_n


@pytest.mark.triton
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("num_splits", [None, 3, 32])   # 32: decode rows merge 32 splits a round (batch 1)
@pytest.mark.parametrize("queries", [(16, 9, 1), (1, 1, 1)])  # blocks (the merge kernel), decode rows (in-kernel)
def test_each_sequence_splits_by_its_own_length_so_graphs_and_eager_steps_sum_alike(causal, num_splits, queries):
    """A CUDA graph's metadata has max_seq_len = the whole capacity, an eager step's the batch's longest sequence:
    the grids differ (2 splits against 32 here), but every sequence's keys are cut at the same places, chosen from
    its own length, and merged in the same rounds, so the results are bit-identical (a graphed and an eager engine
    decode and verify alike)."""
    from engine import triton_attention as ta

    meta, k_cache, v_cache, query = _triton_case(torch.float32, torch.float32, 1.0, 16,
                                                 list(zip((300, 20, 3), queries)), num_q_heads=8)
    meta.causal = causal
    eager = ta.decode_attention(query, k_cache, v_cache, meta, 0.2, num_splits=num_splits)
    assert rel_err(eager, run("torch", query, k_cache, v_cache, meta, 0.2)) < 1e-5
    block_n, most = ta.decode_block_n(k_cache), ta.max_split_tiles_for(ta.decode_block_n(k_cache))
    meta.max_seq_len = 32 * most * block_n             # a graph's: the block table's capacity
    assert ta.grid_splits(meta.max_seq_len, block_n, num_splits or 1, most) == 32
    graphed = ta.decode_attention(query, k_cache, v_cache, meta, 0.2, num_splits=num_splits)
    assert torch.equal(eager, graphed)


def test_short_blocks_take_the_split_kernel_only_while_the_varlen_grid_leaves_multiprocessors_idle(monkeypatch):
    from engine import triton_attention

    monkeypatch.setattr(triton_attention, "_multiprocessor_count", lambda device: 132)
    prefers = triton_attention.prefers_split_kv
    cpu = torch.device("cpu")
    # Qwen3-8B heads (32 query, 8 kv): verification of 16 tokens at batch 1 and 8 splits, at 32 (256 programs) not.
    assert prefers(16, 1, 32, 8, cpu) and prefers(16, 8, 32, 8, cpu) and not prefers(16, 32, 32, 8, cpu)
    assert prefers(1, 128, 32, 8, cpu)                       # decode always
    assert not prefers(17, 1, 32, 8, cpu)                    # 17 x 4 rows exceed a program
    assert prefers(32, 1, 4, 2, cpu) and not prefers(33, 1, 4, 2, cpu)     # the demo pair's group of 2
    # Judged on the graph's padded batch: 9 rows pad to 16 (128 programs), 17 to 24 (192); 64 x 2 kv heads fit, 65
    # (72 padded) do not, as in the graphed step.
    assert prefers(16, 9, 32, 8, cpu) and not prefers(16, 17, 32, 8, cpu)
    assert prefers(16, 64, 4, 2, cpu) and not prefers(16, 65, 4, 2, cpu)
    ladder = capture_sizes(256)
    assert all(triton_attention.graph_batch(n) == next(s for s in ladder if s >= n) for n in range(1, 257))


@pytest.mark.triton
@pytest.mark.parametrize("cache_dtype,kv_scale,page_size", [(torch.bfloat16, 1.0, 1), (FP8_DTYPE, 0.02, 64)])
def test_triton_decode_handles_head_dim_below_tile_and_rows_without_query(cache_dtype, kv_scale, page_size):
    """Head dim 24 in a 32-wide tile takes the dim-masked loads (32 takes row-only ones); a sequence with no query
    this step (batch padding) is skipped without disturbing its neighbours' splits; tiles span pages (page 1) or
    sit inside one (page 64)."""
    from engine.triton_attention import decode_attention

    spec = [(40, 1), (21, 0), (0, 1), (90, 1)]
    meta, k_cache, v_cache, query = _triton_case(torch.bfloat16, cache_dtype, kv_scale, page_size, spec,
                                                 num_q_heads=8, head_dim=24)
    kw = dict(k_scale=kv_scale, v_scale=kv_scale)
    ref = run("torch", query, k_cache, v_cache, meta, 0.2, **kw)
    for num_splits in (1, 4):
        out = decode_attention(query, k_cache, v_cache, meta, 0.2, num_splits=num_splits, **kw)
        assert rel_err(out, ref) < LOW_PRECISION_TOL


def test_decode_splits_fill_the_multiprocessors(monkeypatch):
    """A lone sequence is split until every multiprocessor has a program; a batch that fills the GPU is not split;
    a sequence of fewer tiles takes fewer splits, and one longer than that many splits of MAX_SPLIT_KEYS keys more,
    so the grid covers it."""
    from engine import triton_attention as ta

    monkeypatch.setattr(ta, "_multiprocessor_count", lambda device: 132)  # an H100 / H200
    cpu = torch.device("cpu")
    splits = ta.splits_per_sequence
    assert splits(1, 8, cpu) == 32                     # batch 1 x 8 kv heads: 256 programs for 132 multiprocessors
    assert splits(8, 8, cpu) == 4 and splits(5, 8, cpu) == 4        # 5 rows pad to a graph of 8
    assert splits(32, 8, cpu) == 1 and splits(128, 8, cpu) == 1
    assert splits(32, 8, cpu, programs_per_multiprocessor=2) == 2
    assert ta.grid_splits(3 * 128, 128, 32, 64) == 3                # 3 tiles: 3 splits at most
    assert ta.grid_splits(1000 * 128, 128, 1, 64) == 16             # 1,000 tiles, at most 64 a split


@pytest.mark.triton
@pytest.mark.parametrize("cache_dtype,num_q_heads,causal", [(torch.float32, 4, True), (FP8_DTYPE, 2, False)])
def test_precompile_launches_every_variant_a_step_can_take(cache_dtype, num_q_heads, causal, monkeypatch):
    """A variant first met while serving compiles inside a step and stalls the replica (1-2 s on an H200):
    ``precompile`` must launch every one that batches of any query length, sequence count, context and split
    setting over these caches choose, as the wrappers choose them."""
    from engine import triton_attention as ta

    # Contexts of up to 20 tiles with as many multiprocessors as an H100: up to 32 splits, merged 16 at a time.
    monkeypatch.setattr(ta, "_multiprocessor_count", lambda device: 132)
    page_size = 4
    _, k_cache, v_cache = make_layer_caches(24, page_size, cache_dtype)
    max_seq_len = 20 * ta.decode_block_n(k_cache)
    launched = ta.precompile(num_q_heads, k_cache, v_cache, torch.float32, causal=causal, max_seq_len=max_seq_len,
                             k_scale=0.5, v_scale=0.5)
    group = num_q_heads // NUM_KV_HEADS
    needed = {("store",)}
    for q in range(1, 65):
        needed |= {("varlen", ta.varlen_block_m(q, group), causal, flat) for flat in (False, True)}
    for q in range(1, ta.split_kv_max_query_len(group) + 1):
        block_n = ta.decode_block_n(k_cache, ta.decode_block_m(q, group))
        for num_seqs in range(1, 9):
            wanted = ta.splits_per_sequence(num_seqs, NUM_KV_HEADS, torch.device(DEVICE))
            for seq_len in range(q, max_seq_len + 1):
                splits = ta.grid_splits(seq_len, block_n, wanted, ta.max_split_tiles_for(block_n))
                merge_rows = ta.in_kernel_merge_rows(q, group, splits == 1)
                needed.add(("decode", ta.decode_block_m(q, group), causal and q > 1, splits == 1, merge_rows,
                            merge_rows and ta.merge_splits(merge_rows, wanted)))
                if splits > 1 and not merge_rows:
                    needed.add(("reduce",))
    assert needed <= launched, needed - launched
    assert ("decode", 16, False, True, 0, 0) in needed
    # Decode rows merged in the split kernel, in rounds of both sizes (batch 1, larger batches).
    assert len({key[5] for key in needed if key[0] == "decode" and key[4]}) >= 2
    assert ("reduce",) in needed                                          # blocks of more rows


def test_kernels_do_not_specialise_on_values_that_vary_between_steps():
    """Every argument named unspecialised exists in some kernel and is declared so there (a renamed argument would
    silently bring the per-step recompiles back); the caches, queries and outputs keep their alignment."""
    import inspect

    from engine import triton_attention as ta

    def declared(kernel, option):      # compiled kernels keep their options per parameter, the interpreter as given
        if hasattr(kernel, "params"):
            return {p.name for p in kernel.params if getattr(p, option)}
        return set(kernel.kwargs.get(option) or ())

    kernels = [ta._store_kv_kernel, ta._varlen_attention_kernel, ta._decode_split_kernel, ta._decode_reduce_kernel]
    for option, names in (("do_not_specialize", ta.RUNTIME_INTS),
                          ("do_not_specialize_on_alignment", ta.METADATA_POINTERS)):
        for name in names:
            having = [k for k in kernels if name in inspect.signature(k.fn).parameters]
            assert having and all(name in declared(k, option) for k in having), (option, name)
    kept = {"q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr", "key_ptr", "value_ptr", "partial_out_ptr"}
    assert not any(kept & declared(k, "do_not_specialize_on_alignment") for k in kernels)
