"""Triton kernels for the paged KV cache: the store (with fp8 quantize), varlen attention, and split-KV decode.

The same source compiles for the GPU and runs under TRITON_INTERPRET=1 on CPU (triton 3.9's interpreter loads
and stores float8_e4m3fn natively). Two interpreter gaps shape it: its tl.dot multiplies bf16 operands as raw
integer bits, so under the interpreter bf16 tiles are upcast to fp32 before a dot; and its downcasts truncate
(fp32 -> bf16) or round ties away and flush subnormals (-> fp8), so stores round to the target grid in fp32
arithmetic first, after which the cast is exact on both and bit-equal to torch's round-to-nearest-even.
FP8 scales are folded rather than applied per element: k_scale into the softmax scale, v_scale into the output.
"""

from __future__ import annotations

import functools
import os
import threading
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from engine.attention import FP8_DTYPE, FP8_MAX, AttentionMetadata

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
LOG2E = 1.4426950408889634
# Triton compiles a kernel anew for every new combination of its arguments' "specialisations": an integer that is
# 1 or a multiple of 16, a pointer 16-byte aligned or not. The arguments below vary from step to step (a batch's
# block-table width, its split count, a metadata tensor sliced at any row), so a server met combinations its
# warm-up had not and stalled for a compile (1-2 s on an H200) in the middle of serving. They are never
# specialised: none of them sizes a vector load (the K/V caches, queries and outputs keep theirs).
RUNTIME_INTS = ["stride_bt", "num_q_heads", "num_splits", "splits_per_seq", "num_seqs"]
METADATA_POINTERS = ["slot_mapping_ptr", "block_tables_ptr", "query_start_loc_ptr", "seq_lens_ptr"]
FP8_MAX_C = tl.constexpr(FP8_MAX)
# Programmatic dependent launch (sm_90 and later): a step's kernels (these and ``engine.triton_ops``') are launched
# while the kernel before them still runs. Each waits for that kernel to finish and its writes to be visible
# (``griddepcontrol.wait``) before it reads or writes anything of the step's, then lets the next one launch; the
# few-row linears first prefetch their leading weight tiles, which nothing writes. The gap between two kernels (the
# launch, a grid's ramp) overlaps the kernel before, and the short kernels between the linears overlap a linear's
# first weight reads. None: on wherever the GPU has it; False: off (benchmarks compare the two).
PDL: bool | None = None


def pdl(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch programmatically dependent (``PDL``)."""
    if INTERPRET or device.type != "cuda" or torch.version.hip or PDL is False:
        return False
    return PDL or _capability(device) >= (9, 0)


def _pdl_args(device: torch.device) -> dict:
    """A launch's keywords for ``PDL``: the kernel's constexpr and the launch's attribute (none when off, for the
    interpreter takes neither)."""
    return {"PDL": True, "launch_pdl": True} if pdl(device) else {}


@triton.jit
def _await_previous_kernel(PDL: tl.constexpr):
    """With ``PDL``: wait until the kernel before this one has finished and its writes are visible, then let the
    next kernel launch. Every program calls it first, those that exit early too, so that this kernel never
    finishes before the one it follows (the next kernel's wait covers both)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


# ----------------------------------------------------------------------------------------------------- store


@triton.jit
def _to_e4m3(x):
    """float8_e4m3fn of fp32 x as torch casts it: saturate at +-448, round to nearest even, keep the sign of 0."""
    magnitude = tl.minimum(tl.abs(x), FP8_MAX_C)
    exponent = ((magnitude.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, -6)  # subnormals share the smallest normal's spacing, 2**-9
    # e4m3 keeps 3 mantissa bits, so values in [2**e, 2**(e+1)) are spaced 2**(e-3).
    spacing = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
    inv_spacing = ((127 - exponent + 3) << 23).to(tl.float32, bitcast=True)
    steps = magnitude * inv_spacing  # exact: a power-of-two scaling, steps <= 16
    # Adding 1.5 * 2**23 leaves no fraction bits, so fp32 addition rounds to an integer, ties to even.
    steps = (steps + 12582912.0) - 12582912.0
    # The rounded magnitude is an e4m3 value, so its cast is exact everywhere. The sign goes in as a bit: on an
    # H200 a negated zero came out of the cast as +0 where torch stores -0.
    code = (steps * spacing).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    sign = ((x.to(tl.int32, bitcast=True) >> 24) & 0x80).to(tl.uint8)
    return (code | sign).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _round_to_bf16_grid(x):
    """Round fp32 x to the nearest bfloat16 value, ties to even, keeping it in fp32."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # -65536 == 0xFFFF0000 as int32
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _store_rounded(ptrs, x, scale, mask):
    """Store x rounded to nearest even into the pointers' dtype, as torch casts; fp8 divides by scale, saturates."""
    if ptrs.dtype.element_ty == tl.float8e4nv:
        x = _to_e4m3(tl.math.div_rn(x.to(tl.float32), scale))  # IEEE division, like torch; "/" is approximate
    elif ptrs.dtype.element_ty == tl.bfloat16:
        if x.dtype == tl.float32:
            x = _round_to_bf16_grid(x)
    tl.store(ptrs, x.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize_on_alignment=METADATA_POINTERS)
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    k_scale, v_scale,
    stride_key_t, stride_key_h, stride_value_t, stride_value_h,
    stride_kc_page, stride_kc_tok, stride_kc_head,
    stride_vc_page, stride_vc_tok, stride_vc_head,
    num_heads, head_dim,
    PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False,
):
    """One program per token: copy its [H, D] key and value rows into their cache slot."""
    _await_previous_kernel(PDL)
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    page = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_heads) & (dims < head_dim)

    key = tl.load(key_ptr + token * stride_key_t + heads * stride_key_h + dims, mask=mask)
    k_dst = k_cache_ptr + page * stride_kc_page + offset * stride_kc_tok + heads * stride_kc_head + dims
    _store_rounded(k_dst, key, k_scale, mask)

    value = tl.load(value_ptr + token * stride_value_t + heads * stride_value_h + dims, mask=mask)
    v_dst = v_cache_ptr + page * stride_vc_page + offset * stride_vc_tok + heads * stride_vc_head + dims
    _store_rounded(v_dst, value, v_scale, mask)


def store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0) -> None:
    """Triton version of engine.attention.store_kv (same contract)."""
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    for name, x in (("key", key), ("value", value)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name}'s last dim must be contiguous, got strides {x.stride()}")
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        float(k_scale), float(v_scale),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        num_heads, head_dim,
        PAGE_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4, **_pdl_args(key.device),
    )


# ------------------------------------------------------------------------------------------------- attention


@triton.jit
def _dot(a, b, DOT_DTYPE: tl.constexpr):
    """a @ b with fp32 accumulation, operands in DOT_DTYPE ("fp32" uses exact, not tf32, products)."""
    if DOT_DTYPE == "fp32":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif DOT_DTYPE == "bf16":
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    else:
        return tl.dot(a.to(tl.float16), b.to(tl.float16))


@triton.jit
def _rows_mask(row_valid, dims, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Mask of a [rows, BLOCK_D] tile. Row-only when the tile is exactly the head dim: a mask that varies along
    the contiguous dim makes Triton load element by element (one byte at a time for fp8) instead of 16 bytes."""
    if HEAD_DIM == BLOCK_D:
        return row_valid[:, None]
    else:
        return row_valid[:, None] & (dims[None, :] < HEAD_DIM)


@triton.jit
def _tile_pages(block_table_ptr, tile_start, kv_end, stride_page, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Where the page of each kv position of the tile at tile_start begins (its page id times ``stride_page``;
    page 0 past kv_end): a tile may span pages or sit in one. Multiplied here, once a position, so that the K/V
    loads' addresses add an offset that stays the same from tile to tile (``_slot_offsets``)."""
    pos = tile_start + tl.arange(0, BLOCK_N)
    page = tl.load(block_table_ptr + pos // PAGE_SIZE, mask=pos < kv_end, other=0)
    return page.to(tl.int64) * stride_page


@triton.jit
def _tile_kv_pages(block_table_ptr, tile_start, kv_end, stride_k_page, stride_v_page, PAGE_SIZE: tl.constexpr,
                   BLOCK_N: tl.constexpr, SAME_PAGE_STRIDE: tl.constexpr):
    """``_tile_pages`` for K and for V (one for both when their page strides are equal, as in a pool's pages)."""
    k_page = _tile_pages(block_table_ptr, tile_start, kv_end, stride_k_page, PAGE_SIZE, BLOCK_N)
    if SAME_PAGE_STRIDE:
        v_page = k_page
    else:
        v_page = _tile_pages(block_table_ptr, tile_start, kv_end, stride_v_page, PAGE_SIZE, BLOCK_N)
    return k_page, v_page


@triton.jit
def _slot_offsets(tile_start, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Each kv position's slot in its page, for a tile that starts at a multiple of BLOCK_N (every caller's
    tiles do): the same for every tile when a tile spans whole pages, so the compiler hoists it out of the loop."""
    if BLOCK_N % PAGE_SIZE == 0:
        return tl.arange(0, BLOCK_N) % PAGE_SIZE
    elif PAGE_SIZE % BLOCK_N == 0:
        return tile_start % PAGE_SIZE + tl.arange(0, BLOCK_N)
    else:
        return (tile_start + tl.arange(0, BLOCK_N)) % PAGE_SIZE


@triton.jit
def _attend_kv_tile(
    q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, k_page, v_page, kv_head, tile_start, kv_end, row_pos,
    qk_scale_log2, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    CAUSAL: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, DOT_DTYPE: tl.constexpr, WIDEN_V: tl.constexpr,
):
    """One online-softmax step over kv positions [tile_start, tile_start + BLOCK_N) (``k_page``/``v_page``: where
    each position's page begins in K/V, ``_tile_pages``); returns the new (m, l, acc). K rows past kv_end are read
    from page 0 unmasked (their scores are masked out); V rows are masked, as a zero probability times a NaN that a
    page may hold would still be NaN. ``WIDEN_V`` (FP8 caches) widens the V tile to the dot's dtype as it arrives
    and zeroes its masked rows after: the widened tile then reaches the tensor cores through 16-bit
    transposed shared-memory loads, where an FP8 tile widened at the product is read from shared memory a byte at
    a time (no 8-bit transposed ldmatrix on sm_90)."""
    pos = tile_start + tl.arange(0, BLOCK_N)
    pos_valid = pos < kv_end
    dims = tl.arange(0, BLOCK_D)
    kv_mask = _rows_mask(pos_valid, dims, HEAD_DIM, BLOCK_D)
    slot_in_page = _slot_offsets(tile_start, PAGE_SIZE, BLOCK_N)
    k_rows = k_page + (slot_in_page * stride_k_tok + kv_head * stride_k_head)
    if HEAD_DIM == BLOCK_D:
        k = tl.load(k_cache_ptr + k_rows[:, None] + dims[None, :])
    else:
        k = tl.load(k_cache_ptr + k_rows[:, None] + dims[None, :], mask=dims[None, :] < HEAD_DIM, other=0.0)

    scores = _dot(q, tl.trans(k), DOT_DTYPE) * qk_scale_log2  # log2 domain: softmax via exp2
    visible = pos_valid[None, :]
    if CAUSAL:
        visible = visible & (pos[None, :] <= row_pos[:, None])
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    p = tl.exp2(scores - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)

    v_rows = v_page + (slot_in_page * stride_v_tok + kv_head * stride_v_head)
    v_ptrs = v_cache_ptr + v_rows[:, None] + dims[None, :]
    if WIDEN_V:
        v = tl.where(kv_mask, tl.load(v_ptrs, mask=kv_mask).to(tl.float16 if DOT_DTYPE == "fp16" else tl.bfloat16), 0.0)
    else:
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + _dot(p, v, DOT_DTYPE)
    return m_new, l_i, acc


# Running max starts finite so rows that see nothing yet (padding, empty splits) give p = 0, never NaN.
M_INIT = tl.constexpr(-1.0e30)


@triton.jit
def _find_seq(query_start_loc_ptr, program, num_seqs, BLOCK_Q: tl.constexpr):
    """(sequence, its query block) of flat program ``program``: sequence s owns the programs from
    query_start_loc[s] // BLOCK_Q + s on (at least ceil(q_len / BLOCK_Q) of them, strictly increasing starts),
    so a binary search over the B + 1 query starts finds it."""
    lo = program * 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= program:
            lo = mid
        else:
            hi = mid - 1
    return lo, program - (tl.load(query_start_loc_ptr + lo) // BLOCK_Q + lo)


@triton.jit(do_not_specialize=RUNTIME_INTS, do_not_specialize_on_alignment=METADATA_POINTERS)
def _varlen_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    qk_scale_log2, v_scale,
    stride_q_t, stride_q_h, stride_o_t, stride_o_h,
    stride_k_page, stride_k_tok, stride_k_head, stride_v_page, stride_v_tok, stride_v_head,
    stride_bt, num_seqs,
    GROUP: tl.constexpr, CAUSAL: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr, FLAT: tl.constexpr, SAME_PAGE_STRIDE: tl.constexpr = False, PDL: tl.constexpr = False,
):
    """Program (q block, seq, kv head), or with ``FLAT`` (flat q block, kv head): BLOCK_Q query tokens x the GQA
    group's GROUP heads as BLOCK_M rows. A flat grid has T // BLOCK_Q + B programs per kv head whatever the
    rows' lengths (a CUDA graph of a ragged batch fixes only T and B); the other, max q blocks x B."""
    _await_previous_kernel(PDL)
    if FLAT:
        seq, q_block = _find_seq(query_start_loc_ptr, tl.program_id(0), num_seqs, BLOCK_Q)
        kv_head = tl.program_id(1)
    else:
        q_block = tl.program_id(0)
        seq = tl.program_id(1)
        kv_head = tl.program_id(2)
    q_begin = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    first_token = q_block * BLOCK_Q
    if first_token >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    # Row r is query token first_token + r // GROUP, head kv_head * GROUP + r % GROUP: the group shares each
    # K/V tile, so a kv head's pages are read once per query block rather than once per query head.
    rows = tl.arange(0, BLOCK_M)
    row_token = first_token + rows // GROUP
    row_head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (row_token < q_len)
    row_pos = context_len + row_token
    dims = tl.arange(0, BLOCK_D)
    io_mask = _rows_mask(row_valid, dims, HEAD_DIM, BLOCK_D)
    q_offsets = (q_begin + row_token)[:, None] * stride_q_t + row_head[:, None] * stride_q_h + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=io_mask, other=0.0)

    if CAUSAL:
        kv_end = tl.minimum(seq_len, context_len + tl.minimum(first_token + BLOCK_Q, q_len))
    else:
        kv_end = seq_len
    m_i = tl.full([BLOCK_M], M_INIT, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    block_table_ptr = block_tables_ptr + seq * stride_bt
    for tile_start in range(0, kv_end, BLOCK_N):
        k_page, v_page = _tile_kv_pages(block_table_ptr, tile_start, kv_end, stride_k_page, stride_v_page,
                                        PAGE_SIZE, BLOCK_N, SAME_PAGE_STRIDE)
        m_i, l_i, acc = _attend_kv_tile(
            q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, k_page, v_page, kv_head, tile_start, kv_end, row_pos,
            qk_scale_log2, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
            CAUSAL, PAGE_SIZE, BLOCK_N, HEAD_DIM, BLOCK_D, DOT_DTYPE, False,
        )
    l_i = tl.where(l_i > 0, l_i, 1.0)
    out = acc * (v_scale / l_i)[:, None]  # V's fp8 scale applied once, to the output, instead of per element
    o_offsets = (q_begin + row_token)[:, None] * stride_o_t + row_head[:, None] * stride_o_h + dims[None, :]
    _store_rounded(out_ptr + o_offsets, out, 1.0, io_mask)


@triton.jit
def _seq_split(seq_len, splits_per_seq, BLOCK_N: tl.constexpr, MAX_SPLIT_TILES: tl.constexpr):
    """(keys per split, splits that hold keys) of a sequence of seq_len keys: splits_per_seq splits of whole tiles,
    fewer for a sequence of fewer tiles, more for one longer than that many splits of MAX_SPLIT_TILES tiles. It
    depends on the sequence alone, so a CUDA graph (whose grid spans the capacity) and an eager step (whose grid
    spans the batch's longest sequence) cut every sequence's keys at the same places and sum alike, to the bit."""
    tiles = tl.cdiv(seq_len, BLOCK_N)
    wanted = tl.maximum(splits_per_seq, tl.cdiv(tiles, MAX_SPLIT_TILES))
    # At least one tile a split, so that a row of no keys (batch padding) divides by nothing.
    tiles_per_split = tl.maximum(tl.cdiv(tiles, tl.maximum(tl.minimum(wanted, tiles), 1)), 1)
    return tiles_per_split * BLOCK_N, tl.cdiv(tiles, tiles_per_split)


@triton.jit(do_not_specialize=RUNTIME_INTS, do_not_specialize_on_alignment=METADATA_POINTERS)
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, partial_out_ptr, partial_lse_ptr, merge_count_ptr,
    block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    qk_scale_log2, v_scale,
    stride_q_t, stride_q_h, stride_o_t, stride_o_h,
    stride_k_page, stride_k_tok, stride_k_head, stride_v_page, stride_v_tok, stride_v_head,
    stride_bt, num_q_heads, num_splits, splits_per_seq,
    GROUP: tl.constexpr, CAUSAL: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, DOT_DTYPE: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr, PREFETCH_PAGES: tl.constexpr, MAX_SPLIT_TILES: tl.constexpr,
    WIDEN_V: tl.constexpr, SAME_PAGE_STRIDE: tl.constexpr = False, PDL: tl.constexpr = False,
    MERGE_ROWS: tl.constexpr = 0, MERGE_SPLITS: tl.constexpr = 16,
):
    """Program (seq, kv head, split): the sequence's queries (one when decoding, a short block when verifying
    drafts or drafting) x the GQA group against one split of its KV (``_seq_split``). ``PREFETCH_PAGES`` loads
    each tile's page ids one tile ahead, so that the K/V loads do not wait on them. With ``MERGE_ROWS`` (the
    program's real rows, a power of two), the last split of a (seq, kv head) to finish merges the partials itself
    (``_merge_in_last_program``) instead of a merge kernel of its own."""
    _await_previous_kernel(PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # Loaded together, before any branch: at batch 1 each dependent round trip to memory is a visible share.
    q_begin = tl.load(query_start_loc_ptr + seq)
    q_end = tl.load(query_start_loc_ptr + seq + 1)
    seq_len = tl.load(seq_lens_ptr + seq)
    split_len, seq_splits = _seq_split(seq_len, splits_per_seq, BLOCK_N, MAX_SPLIT_TILES)
    kv_begin = split * split_len
    if (q_end == q_begin) | (kv_begin >= seq_len):
        return  # no query (batch padding), or past the sequence's splits (a shorter one): the merge skips it
    kv_end = tl.minimum(seq_len, kv_begin + split_len)

    # Row r is query token r // GROUP, head kv_head * GROUP + r % GROUP: all the tokens' GROUP query heads of the
    # kv head are rows of one tile, so each K/V byte is read once per split.
    rows = tl.arange(0, BLOCK_M)
    row_token = rows // GROUP
    row_valid = row_token < q_end - q_begin
    heads = kv_head * GROUP + rows % GROUP
    row_pos = seq_len - (q_end - q_begin) + row_token  # the token's position: causal rows see keys up to it
    dims = tl.arange(0, BLOCK_D)
    io_mask = _rows_mask(row_valid, dims, HEAD_DIM, BLOCK_D)
    tokens = q_begin + row_token
    q = tl.load(q_ptr + tokens[:, None] * stride_q_t + heads[:, None] * stride_q_h + dims[None, :], mask=io_mask,
                other=0.0)

    m_i = tl.full([BLOCK_M], M_INIT, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    block_table_ptr = block_tables_ptr + seq * stride_bt
    # A lone query sits at the last position and sees every stored key, so causal and non-causal agree for it.
    if PREFETCH_PAGES:
        k_page, v_page = _tile_kv_pages(block_table_ptr, kv_begin, kv_end, stride_k_page, stride_v_page, PAGE_SIZE,
                                        BLOCK_N, SAME_PAGE_STRIDE)
    for tile_start in range(kv_begin, kv_end, BLOCK_N):
        if PREFETCH_PAGES:
            next_k_page, next_v_page = _tile_kv_pages(block_table_ptr, tile_start + BLOCK_N, kv_end, stride_k_page,
                                                      stride_v_page, PAGE_SIZE, BLOCK_N, SAME_PAGE_STRIDE)
        else:
            k_page, v_page = _tile_kv_pages(block_table_ptr, tile_start, kv_end, stride_k_page, stride_v_page,
                                            PAGE_SIZE, BLOCK_N, SAME_PAGE_STRIDE)
        m_i, l_i, acc = _attend_kv_tile(
            q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, k_page, v_page, kv_head, tile_start, kv_end, row_pos,
            qk_scale_log2, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
            CAUSAL, PAGE_SIZE, BLOCK_N, HEAD_DIM, BLOCK_D, DOT_DTYPE, WIDEN_V,
        )
        if PREFETCH_PAGES:
            k_page = next_k_page
            v_page = next_v_page
    # A causal row may see no key of a late split (l = 0): its partial is 0 with no softmax mass (lse -inf).
    out = acc * (v_scale / tl.where(l_i > 0, l_i, 1.0))[:, None]
    if SINGLE_SPLIT:
        _store_rounded(out_ptr + tokens[:, None] * stride_o_t + heads[:, None] * stride_o_h + dims[None, :], out, 1.0,
                       io_mask)
    elif seq_splits == 1:  # the merge of one split would give these very bits; it skips the sequence
        _store_rounded(out_ptr + tokens[:, None] * stride_o_t + heads[:, None] * stride_o_h + dims[None, :], out, 1.0,
                       io_mask)
    else:
        # Partials are [T, Hq, num_splits, D] normalised outputs plus their log2-sum-exp.
        partial_rows = (tokens * num_q_heads + heads) * num_splits + split
        tl.store(partial_out_ptr + partial_rows[:, None] * BLOCK_D + dims[None, :], out, mask=io_mask)
        tl.store(partial_lse_ptr + partial_rows, m_i + tl.log2(l_i), mask=row_valid)
        if MERGE_ROWS > 0:
            _merge_in_last_program(partial_out_ptr, partial_lse_ptr, merge_count_ptr, out_ptr, seq, kv_head,
                                   q_begin, q_end, seq_splits, stride_o_t, stride_o_h, num_q_heads, num_splits,
                                   GROUP, HEAD_DIM, BLOCK_D, MERGE_ROWS, MERGE_SPLITS)


@triton.jit
def _merge_in_last_program(partial_out_ptr, partial_lse_ptr, merge_count_ptr, out_ptr, seq, kv_head, q_begin, q_end,
                           seq_splits, stride_o_t, stride_o_h, num_q_heads, num_splits, GROUP: tl.constexpr,
                           HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, SPLITS: tl.constexpr):
    """Count this split in on its (seq, kv head)'s counter; the split that counts last merges every split's
    partials (rows: the queries x the GQA group), MERGE_SPLITS at a time in split order, and puts the counter
    back to zero for the next launch. The sum is the same whichever split comes last, so graphed and eager steps
    agree to the bit.

    Ordering: the barrier puts every thread's partial stores before the one thread's counting, whose acquire-release
    atomic (GPU scope) publishes them to, and orders them before, the last program's loads, which bypass L1."""
    tl.debug_barrier()
    counter = merge_count_ptr + seq * (num_q_heads // GROUP) + kv_head
    if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == seq_splits - 1:
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
        rows = tl.arange(0, ROWS)
        row_valid = rows // GROUP < q_end - q_begin
        tokens = q_begin + rows // GROUP
        heads = kv_head * GROUP + rows % GROUP
        first = (tokens * num_q_heads + heads) * num_splits
        splits = tl.arange(0, SPLITS)
        dims = tl.arange(0, BLOCK_D)
        top = tl.full([ROWS], float("-inf"), tl.float32)
        total = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
        for chunk in range(0, seq_splits, SPLITS):
            valid = row_valid[:, None] & (chunk + splits < seq_splits)[None, :]
            at = first[:, None] + chunk + splits[None, :]
            lse = tl.load(partial_lse_ptr + at, mask=valid, other=float("-inf"), cache_modifier=".cg")
            if HEAD_DIM == BLOCK_D:   # as ``_rows_mask``: a mask along the contiguous dim splits the loads
                partial_mask = valid[:, :, None]
            else:
                partial_mask = valid[:, :, None] & (dims < HEAD_DIM)[None, None, :]
            partial = tl.load(partial_out_ptr + at[:, :, None] * BLOCK_D + dims[None, None, :], mask=partial_mask,
                              other=0.0, cache_modifier=".cg")
            new_top = tl.maximum(top, tl.max(lse, axis=1))
            # A row with no softmax mass yet (a causal row's late splits, a padding row) keeps weights of 0.
            base = tl.where(new_top == float("-inf"), 0.0, new_top)
            weight = tl.exp2(lse - base[:, None])
            rescale = tl.exp2(top - base)
            total = total * rescale + tl.sum(weight, axis=1)
            acc = acc * rescale[:, None] + tl.sum(partial * weight[:, :, None], axis=1)
            top = new_top
        out = acc / tl.where(total > 0, total, 1.0)[:, None]
        _store_rounded(out_ptr + tokens[:, None] * stride_o_t + heads[:, None] * stride_o_h + dims[None, :], out, 1.0,
                       _rows_mask(row_valid, dims, HEAD_DIM, BLOCK_D))


@triton.jit(do_not_specialize=RUNTIME_INTS, do_not_specialize_on_alignment=METADATA_POINTERS)
def _decode_reduce_kernel(
    partial_out_ptr, partial_lse_ptr, out_ptr, query_start_loc_ptr, seq_lens_ptr,
    stride_o_t, stride_o_h, num_q_heads, num_splits, splits_per_seq,
    BLOCK_N: tl.constexpr, MAX_SPLIT_TILES: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr, PDL: tl.constexpr = False,
):
    """Program (seq, q head, query of the seq): merge that query's split partials, weighting each by its share of
    the softmax mass. The partials are taken BLOCK_S at a time in a fixed order, so the sum depends on the
    sequence's own splits only, never on how many programs the launch had (a graph's or an eager step's)."""
    _await_previous_kernel(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    token = tl.load(query_start_loc_ptr + seq) + tl.program_id(2)
    q_end = tl.load(query_start_loc_ptr + seq + 1)
    seq_len = tl.load(seq_lens_ptr + seq)
    _, seq_splits = _seq_split(seq_len, splits_per_seq, BLOCK_N, MAX_SPLIT_TILES)
    if (token >= q_end) | (seq_splits == 1):
        return  # no such query, or a sequence of one split, which wrote its output itself
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    first_row = (token * num_q_heads + head) * num_splits
    top = float("-inf")
    for chunk in range(0, seq_splits, BLOCK_S):
        lse = tl.load(partial_lse_ptr + first_row + chunk + splits, mask=chunk + splits < seq_splits,
                      other=float("-inf"))
        top = tl.maximum(top, tl.max(lse, axis=0))
    # Split 0 holds keys every query of a real sequence sees, so the max is finite; a graph's padding rows (q
    # queries over a context of one) may see none, and get 0 rather than NaN.
    top = tl.where(top == float("-inf"), 0.0, top)
    total = 0.0
    acc = tl.zeros([BLOCK_D], tl.float32)
    for chunk in range(0, seq_splits, BLOCK_S):
        valid = chunk + splits < seq_splits
        rows = first_row + chunk + splits
        weight = tl.exp2(tl.load(partial_lse_ptr + rows, mask=valid, other=float("-inf")) - top)
        partial = tl.load(partial_out_ptr + rows[:, None] * BLOCK_D + dims[None, :],
                          mask=_rows_mask(valid, dims, HEAD_DIM, BLOCK_D), other=0.0)
        total += tl.sum(weight, axis=0)
        acc += tl.sum(partial * weight[:, None], axis=0)
    out = acc / tl.where(total > 0, total, 1.0)
    _store_rounded(out_ptr + token * stride_o_t + head * stride_o_h + dims, out, 1.0, dims < HEAD_DIM)


# Registers a varlen program may take, per cache element size. FP8 tiles left to the compiler took 174-192 (2 programs
# of 4 warps a multiprocessor); capped at 168 (3 fit), an H100 ran prefill of 2k tokens and a 2k chunk after 2k
# 4-9% faster (page 16 and 64; benchmarks/attention_check.py's sweep). Capped bf16 tiles ran 5-13% slower.
VARLEN_MAXNREG = {1: 168}


def varlen_attention(query, k_cache, v_cache, meta: AttentionMetadata, scale, k_scale=1.0, v_scale=1.0, *,
                     block_m=None, block_n=None, num_warps=4, num_stages=2, flat_grid=None,
                     maxnreg=None) -> torch.Tensor:
    """Varlen paged attention (prefill chunks, drafter blocks, decode, mixed); block sizes default per device,
    the grid (``flat_grid``) to the one of fewer programs."""
    num_tokens, num_q_heads, head_dim = query.shape
    num_seqs = meta.seq_lens.shape[0]
    group = num_q_heads // k_cache.shape[2]
    out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if block_m is None:
        # Enough rows for the longest sequence's queries times the group, within one tl.dot-friendly tile; the
        # largest tile for a ragged batch (``AttentionMetadata.uniform``).
        block_m = varlen_block_m(meta.max_query_len if meta.uniform else SPLIT_KV_MAX_ROWS, group)
    block_n = block_n or (16 if INTERPRET else 64)
    block_q = block_m // group
    # Both grids give every row the same numbers (its q block and KV tiles are the same): the flat one when the
    # other would launch more programs (one long row among short ones, or a graph's max_query_len of all T).
    flat = flat_grid if flat_grid is not None else (
        num_tokens // block_q + num_seqs < triton.cdiv(meta.max_query_len, block_q) * num_seqs)
    if flat:
        grid = (num_tokens // block_q + num_seqs, k_cache.shape[2])
    else:
        grid = (triton.cdiv(meta.max_query_len, block_q), num_seqs, k_cache.shape[2])
    _varlen_attention_kernel[grid](
        query, k_cache, v_cache, out, meta.block_tables, meta.query_start_loc, meta.seq_lens,
        scale * _fp8_scale(k_cache, k_scale) * LOG2E, _fp8_scale(v_cache, v_scale),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        meta.block_tables.stride(0), num_seqs,
        GROUP=group, CAUSAL=meta.causal, PAGE_SIZE=k_cache.shape[1], BLOCK_Q=block_q, BLOCK_M=block_m,
        BLOCK_N=block_n, HEAD_DIM=head_dim, BLOCK_D=_block_d(head_dim), DOT_DTYPE=_dot_dtype(query, k_cache),
        FLAT=flat, SAME_PAGE_STRIDE=_same_page_stride(k_cache, v_cache), num_warps=num_warps, num_stages=num_stages,
        **_pdl_args(query.device),
        **_register_cap(maxnreg or VARLEN_MAXNREG.get(k_cache.element_size()), query.device),
    )
    return out


def decode_attention(query, k_cache, v_cache, meta: AttentionMetadata, scale, k_scale=1.0, v_scale=1.0, *,
                     num_splits=None, block_n=None, num_warps=None, num_stages=None, prefetch_pages=None,
                     programs_per_multiprocessor=None, max_split_keys=None, widen_v=None,
                     maxnreg=None, merge_in_kernel=None) -> torch.Tensor:
    """Split-KV attention for batches with short query blocks per sequence: one query (decode) or up to
    ``split_kv_max_query_len`` (draft verification, drafter blocks; causal or not, as ``meta`` says). Tiling
    defaults per cache dtype (``prefetch_pages``, ``widen_v`` and ``programs_per_multiprocessor``, which sizes the
    default split count, too); ``num_splits`` sets the splits per sequence (``_seq_split``), ``maxnreg`` caps the
    registers of a program (``DecodeTiling.maxnreg``), ``merge_in_kernel`` whether short rows' splits are merged
    by their last program (default ``MERGE_IN_KERNEL``) or by a merge kernel."""
    num_tokens, num_q_heads, head_dim = query.shape
    num_seqs, num_kv_heads = meta.seq_lens.shape[0], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    if meta.max_query_len > split_kv_max_query_len(group):
        raise ValueError(f"decode_attention takes up to {split_kv_max_query_len(group)} queries per sequence "
                         f"with {group} query heads per kv head, got max_query_len={meta.max_query_len}")
    out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_m = decode_block_m(meta.max_query_len, group)
    tiling = decode_tiling(k_cache, block_m)
    block_n = block_n or decode_block_n(k_cache, block_m)
    splits_per_seq = num_splits or splits_per_sequence(
        num_seqs, num_kv_heads, query.device, programs_per_multiprocessor or tiling.programs_per_multiprocessor)
    max_split_tiles = max_split_tiles_for(block_n, max_split_keys)
    num_splits = grid_splits(meta.max_seq_len, block_n, splits_per_seq, max_split_tiles)
    single = num_splits == 1
    merge_rows = in_kernel_merge_rows(meta.max_query_len, group, single,
                                      MERGE_IN_KERNEL if merge_in_kernel is None else merge_in_kernel)
    block_d = _block_d(head_dim)
    # Dummy 1-element partials when unused: the kernel never touches them, but it needs valid pointers.
    partial_out = query.new_empty((1,) if single else (num_tokens, num_q_heads, num_splits, block_d),
                                  dtype=torch.float32)
    partial_lse = query.new_empty((1,) if single else (num_tokens, num_q_heads, num_splits), dtype=torch.float32)
    counters = merge_counters(query.device, num_seqs * num_kv_heads) if merge_rows else partial_lse
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, k_cache, v_cache, out, partial_out, partial_lse, counters,
        meta.block_tables, meta.query_start_loc, meta.seq_lens,
        scale * _fp8_scale(k_cache, k_scale) * LOG2E, _fp8_scale(v_cache, v_scale),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        meta.block_tables.stride(0), num_q_heads, num_splits, splits_per_seq,
        GROUP=group, CAUSAL=meta.causal and meta.max_query_len > 1, PAGE_SIZE=k_cache.shape[1],
        BLOCK_M=block_m,
        BLOCK_N=block_n, HEAD_DIM=head_dim, BLOCK_D=block_d, DOT_DTYPE=_dot_dtype(query, k_cache),
        SINGLE_SPLIT=single, PREFETCH_PAGES=tiling.prefetch_pages if prefetch_pages is None else prefetch_pages,
        MAX_SPLIT_TILES=max_split_tiles, WIDEN_V=(tiling.widen_v if widen_v is None else widen_v)
        and k_cache.dtype == FP8_DTYPE, SAME_PAGE_STRIDE=_same_page_stride(k_cache, v_cache),
        num_warps=num_warps or tiling.num_warps, num_stages=num_stages or tiling.num_stages,
        MERGE_ROWS=merge_rows, MERGE_SPLITS=merge_splits(merge_rows, splits_per_seq),
        **_pdl_args(query.device), **_register_cap(maxnreg or tiling.maxnreg, query.device),
    )
    if not single and not merge_rows:
        _decode_reduce_kernel[(num_seqs, num_q_heads, meta.max_query_len)](
            partial_out, partial_lse, out, meta.query_start_loc, meta.seq_lens,
            out.stride(0), out.stride(1), num_q_heads, num_splits, splits_per_seq,
            BLOCK_N=block_n, MAX_SPLIT_TILES=max_split_tiles, HEAD_DIM=head_dim, BLOCK_S=REDUCE_BLOCK_S,
            BLOCK_D=block_d, num_warps=4, **_pdl_args(query.device),
        )
    return out


# --- kernel variants: what Triton compiles one kernel for, chosen from a batch's shape -------------------------

def varlen_block_m(max_query_len: int, group: int) -> int:
    """Query rows of a varlen program: enough for the longest sequence's queries times the group, within one
    tl.dot-friendly tile (16, 32 or 64)."""
    return max(16, triton.next_power_of_2(group), min(64, triton.next_power_of_2(max_query_len * group)))


def decode_block_m(max_query_len: int, group: int) -> int:
    """Query rows of a split-KV program (its queries times the group; at most ``SPLIT_KV_MAX_ROWS``)."""
    return max(16, triton.next_power_of_2(max_query_len * group))


# Whether a split-KV launch of short rows (a program's queries x the GQA group within 16, as decode tokens are)
# merges its splits in the last program of each (seq, kv head) to finish instead of in a merge kernel launched
# after it (``_merge_in_last_program``). Blocks of more rows keep the merge kernel: one program would merge up to
# 64 rows' partials alone.
MERGE_IN_KERNEL = True
# Partial elements ([rows, splits] per chunk) that program merges at a time: 16 splits of a decode token's 4 heads,
# 32 in launches of 32 splits a sequence or more (batch 1). On an H100 (Qwen3-8B heads, page 16, one run): at batch
# 1, 32 at a time ran bf16 1.05-1.19x and fp8 1.00-1.06x faster than 16 (1k-16k keys), but at batch 8 bf16 0.95x
# and at batch 32 x 4k bf16 0.86x (the program takes 193 registers instead of 150).
MERGE_ELEMENTS = 64
MERGE_ELEMENTS_MANY_SPLITS = 128


def merge_splits(merge_rows: int, splits_per_seq: int) -> int:
    """Splits the last program merges a round (``MERGE_SPLITS``): from the splits per sequence, which a graph and
    an eager step of the same rows share, so that they merge in the same rounds and agree to the bit."""
    elements = MERGE_ELEMENTS_MANY_SPLITS if splits_per_seq >= 32 else MERGE_ELEMENTS
    return max(1, min(32, elements // max(merge_rows, 1)))


def in_kernel_merge_rows(max_query_len: int, group: int, single: bool, enabled: bool = True) -> int:
    """The rows (a power of two, at least 2) the last split program merges, 0 where a merge kernel does or there
    is nothing to merge (one split). The same for a graph and an eager step of the same rows."""
    rows = max_query_len * group
    if single or not enabled or rows > 16:
        return 0
    return max(2, triton.next_power_of_2(rows))


# Per (device, stream), or per thread under the interpreter: the counters in-kernel merges count splits in. Two
# launches in flight at once (two streams, two threads) never share a set; a set outgrown is kept for the CUDA
# graphs that captured it.
_MERGE_COUNTERS: dict[tuple, torch.Tensor] = {}
_OUTGROWN_COUNTERS: list[torch.Tensor] = []


def merge_counters(device: torch.device, needed: int) -> torch.Tensor:
    """Zeroed int32 counters, at least ``needed`` of them (one per sequence and kv head), for the launches on this
    device's current stream. Every launch leaves them zero: the last program of each (seq, kv head) resets its own.
    A set made during a graph capture is made in the graph's memory pool, which it keeps (its zeroing, replayed
    with the graph, finds them zero anyway). Graphs captured on one stream share its set, so two of them must not
    replay at once on two streams; an engine replays its graphs one after another on its own stream."""
    key = ((device.type, device.index, torch.cuda.current_stream(device).cuda_stream) if device.type == "cuda"
           else (device.type, threading.get_ident()))
    counters = _MERGE_COUNTERS.get(key)
    if counters is None or counters.numel() < needed:
        if counters is not None:
            _OUTGROWN_COUNTERS.append(counters)
        counters = torch.zeros(max(1024, triton.next_power_of_2(needed)), dtype=torch.int32, device=device)
        _MERGE_COUNTERS[key] = counters
    return counters


# Partials a merge program loads at once (``_decode_reduce_kernel``): one size, so one compile.
REDUCE_BLOCK_S = 16


def decode_tiling(k_cache: torch.Tensor, block_m: int = 16) -> DecodeTiling:
    """A split-KV launch's tiling: per cache dtype, and for programs of more than 16 query rows (verification and
    drafter blocks) per ``DECODE_BLOCK_TILING`` where it has one."""
    element_size = k_cache.element_size()
    return DECODE_BLOCK_TILING.get(element_size, DECODE_TILING[element_size]) if block_m > 16 else \
        DECODE_TILING[element_size]


def decode_block_n(k_cache: torch.Tensor, block_m: int = 16) -> int:
    """KV positions per split-KV tile of programs of ``block_m`` query rows (small under the interpreter)."""
    return 16 if INTERPRET else decode_tiling(k_cache, block_m).block_n


def grid_splits(max_seq_len: int, block_n: int, splits_per_seq: int, max_split_tiles: int) -> int:
    """Programs per (sequence, kv head) of a split-KV launch over contexts up to ``max_seq_len``: enough for the
    most splits ``_seq_split`` gives any of its sequences; the programs of a shorter one's missing splits return
    at once."""
    tiles = max(1, triton.cdiv(max_seq_len, block_n))
    return min(tiles, max(splits_per_seq, triton.cdiv(tiles, max_split_tiles)))


def max_split_tiles_for(block_n: int, max_split_keys: int | None = None) -> int:
    """The most tiles one split of a long sequence reads (``_seq_split``): ``MAX_SPLIT_KEYS`` keys by default."""
    return max(1, (max_split_keys or MAX_SPLIT_KEYS) // block_n)


def precompile(num_q_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor, query_dtype: torch.dtype, *,
               causal: bool, max_seq_len: int, k_scale: float = 1.0, v_scale: float = 1.0) -> set[tuple]:
    """Compile now every variant of the store and attention kernels that steps over these caches can take: query
    blocks of any length (each ``varlen_block_m`` / ``decode_block_m``; either varlen grid), causal as the layers
    are, one split or many (and the merge). A variant first met while serving compiles in the middle of a step, and
    every request of the replica waits for it (1-2 s on an H200).

    Runs the kernels over one sequence whose table points every position at page 0, which they only read; the
    store gets no slot, so it writes nothing. Returns the variants launched, as ``(kernel, constexprs...)``."""
    device = k_cache.device
    page_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    group = num_q_heads // num_kv_heads
    tables = torch.zeros((1, triton.cdiv(max_seq_len, page_size)), dtype=torch.int32, device=device)
    seq_lens = torch.tensor([max_seq_len], dtype=torch.int32, device=device)
    key = torch.zeros((1, num_kv_heads, head_dim), dtype=query_dtype, device=device)
    store_kv(key, key, k_cache, v_cache, torch.full((1,), -1, dtype=torch.int64, device=device), k_scale, v_scale)
    launched = {("store",)}
    q = 1
    # Query blocks of 1, 2, 4, ... 64: every varlen tile (it saturates at 64 rows) and every split-KV one (those
    # blocks stop at 64 rows, 64 / group queries).
    while q <= min(max_seq_len, SPLIT_KV_MAX_ROWS):
        query = torch.zeros((q, num_q_heads, head_dim), dtype=query_dtype, device=device)
        meta = AttentionMetadata(query_start_loc=torch.tensor([0, q], dtype=torch.int32, device=device),
                                 seq_lens=seq_lens, block_tables=tables,
                                 slot_mapping=torch.full((q,), -1, dtype=torch.int64, device=device),
                                 max_query_len=q, max_seq_len=max_seq_len, causal=causal, backend="triton")
        for flat in (False, True):
            varlen_attention(query, k_cache, v_cache, meta, 1.0, k_scale, v_scale, flat_grid=flat)
            launched.add(("varlen", varlen_block_m(q, group), causal, flat))
        if q <= split_kv_max_query_len(group):
            block_n = decode_block_n(k_cache, decode_block_m(q, group))
            max_split_tiles = max_split_tiles_for(block_n)
            # (splits per sequence, context): a context of one tile (one split, no merge), and the whole context in
            # a few splits and in 32 (the merges of either, ``merge_splits``).
            for wanted, context in [(1, min(max_seq_len, block_n)), (2, max_seq_len), (32, max_seq_len)]:
                meta.max_seq_len = context
                meta.seq_lens = torch.tensor([context], dtype=torch.int32, device=device)
                splits = grid_splits(context, block_n, wanted, max_split_tiles)
                decode_attention(query, k_cache, v_cache, meta, 1.0, k_scale, v_scale, num_splits=wanted)
                merge_rows = in_kernel_merge_rows(q, group, splits == 1, MERGE_IN_KERNEL)
                launched.add(("decode", decode_block_m(q, group), causal and q > 1, splits == 1, merge_rows,
                              merge_rows and merge_splits(merge_rows, wanted)))
                if splits > 1 and not merge_rows:
                    launched.add(("reduce",))
        q *= 2
    return launched


# Query rows (tokens x GQA group) one split-KV program holds: verification blocks of 16 tokens with 4 query heads
# per kv head fit; longer blocks (prefill chunks) go to the varlen kernel.
SPLIT_KV_MAX_ROWS = 64


def ragged_tiles(uniform: bool, max_query_len: int, group: int) -> bool:
    """Whether a batch takes the varlen kernel's largest query tile (as a ragged CUDA graph does): rows of several
    lengths, or of one length longer than a split-KV block."""
    return not uniform or max_query_len > split_kv_max_query_len(group)


def split_kv_max_query_len(group: int) -> int:
    """The longest query block per sequence that ``decode_attention`` takes, with ``group`` query heads per kv head."""
    return max(1, SPLIT_KV_MAX_ROWS // group)


def prefers_split_kv(max_query_len: int, num_seqs: int, num_q_heads: int, num_kv_heads: int,
                     device: torch.device) -> bool:
    """Whether a batch goes to the split-KV kernel rather than the varlen one: every decode batch; blocks of a few
    queries (verification, drafter blocks) when the varlen kernel's one program per sequence and kv head would
    leave multiprocessors idle (on an H200 at batch 1 a verification block took 27 us split, 32 us varlen; at
    batch 32, where varlen fills the GPU, 73 against 54)."""
    if max_query_len == 1:
        return True
    # Judged on the batch a CUDA graph pads it to, so that an eager step and a graphed one of the same rows take
    # the same kernel.
    return (max_query_len <= split_kv_max_query_len(num_q_heads // num_kv_heads)
            and graph_batch(num_seqs) * num_kv_heads < _multiprocessor_count(device))


def graph_batch(num_seqs: int) -> int:
    """The batch a CUDA graph pads ``num_seqs`` rows to (``engine.cuda_graphs.capture_sizes``' ladder: 1, 2, 4, 8,
    then multiples of 8; the largest size, ``max_num_seqs``, may be off the ladder)."""
    if num_seqs <= 2:
        return num_seqs
    return triton.next_power_of_2(num_seqs) if num_seqs <= 8 else triton.cdiv(num_seqs, 8) * 8


@dataclass(frozen=True)
class DecodeTiling:
    block_n: int  # KV positions per tile
    num_warps: int
    num_stages: int
    # Page ids one tile ahead. Timed apart on an H200 (benchmarks/attention_check.py's sweep, Qwen3-8B heads, page
    # 16): fp8 rose from 56 to 63% of its floor at batch 32 x 4k and from 55 to 59% at 128 x 1k; bf16 fell from 99
    # to 81% and from 100 to 92%. So on for fp8 caches only. Programs per multiprocessor size the split count
    # (``splits_per_sequence``): 4 instead of 2 changed nothing beyond the noise on the H200, 1 was faster on an H100.
    prefetch_pages: bool = False
    programs_per_multiprocessor: int = 1
    # FP8 V widened as it arrives (``_attend_kv_tile``'s ``WIDEN_V``), not at the product. Off: on an H200 it ran
    # 0-14% slower (batch 1-128 x 1k-4k; benchmarks/README.md), though it leaves no byte-wide shared-memory load.
    widen_v: bool = False
    # Registers a thread may take (None: as many as the compiler wants); fewer let more programs share a
    # multiprocessor, at the price of spills. FP8 tiles take 204-207 (2 programs of 4 warps a multiprocessor); on an
    # H100, 168 (3) with 2-3 programs a multiprocessor's worth of splits took 1.0-1.5x as long, 128 (4) 1.2-1.8x.
    maxnreg: int | None = None


# Per cache element size (bytes): 16 KB K tiles, three stages. On an H200 (Qwen3-8B heads, batch 32 x 4k) 128-row
# fp8 tiles ran 1.3x faster than 64-row ones and 8 warps 1.6x slower than 4; bf16 was fastest at 64 rows, 4 warps.
# With the addresses hoisted out of the tile loop (an H100): 64-row fp8 tiles took 1.1-1.6x as long at batch 32.
DECODE_TILING = {1: DecodeTiling(128, 4, 3, prefetch_pages=True), 2: DecodeTiling(64, 4, 3), 4: DecodeTiling(32, 4, 2)}
# Programs of more than 16 query rows (blocks of 16 tokens x a GQA group of 4), where they differ. On an H100
# (Qwen3-8B heads, batch 1, page 16, one run of every tiling): fp8 verification blocks of 16 over 1k / 4k keys took
# 9.9 / 17.1 us a layer with 64-key tiles against 11.4 / 23.6 us with 128 (1.15 / 1.39x), drafter blocks 9.8 / 17.4
# against 11.0 / 23.4; 32-key tiles were 1.31x at 4k and slower at 1k. bf16 blocks kept 64-key tiles: 32 gained
# 1.24x on a 4k verification block, nothing on a drafter block, and lost at 1k.
DECODE_BLOCK_TILING = {1: DecodeTiling(64, 4, 3, prefetch_pages=True)}
# Keys one split of a long sequence reads at most: a long sequence in a batch of short ones gets more splits than
# they do (``_seq_split``), so its programs do not run alone long after theirs. On an H100 (per layer, a CUDA graph's
# metadata: the grid spans a 32k capacity), 2048 against 4096 and 8192: a 16k sequence among 31 of 1k 90 against 134
# and 206 us (fp8), 32k among 31 of 2k 118 against 163 and 252 us; uniform batches within 5% of one another, but
# batch 32 x 4k (fp8 122 against 116 us, bf16 224 against 202) and 128 x 1k (fp8 144 against 131-133 us).
MAX_SPLIT_KEYS = 64 if INTERPRET else 2048


def splits_per_sequence(num_seqs: int, num_kv_heads: int, device: torch.device,
                        programs_per_multiprocessor: int = 1) -> int:
    """Splits per sequence of a split-KV launch: a power of two that gives every multiprocessor
    ``programs_per_multiprocessor`` programs (``_seq_split`` takes fewer for a sequence of fewer tiles). Judged on
    the batch a CUDA graph pads ``num_seqs`` to, so that an eager step and a graphed one of the same rows split
    alike.

    On an H100 (8 kv heads, page 16; split kernel and merge timed together in CUDA graphs, every split count of each
    case in one run): one program per multiprocessor was the fastest count or within 3% of it in every case, fp8
    and bf16, batch 1-128 x context 1k-16k; two (the earlier default) took 1.0-1.3x as long, e.g. batch 32 x 1k
    fp8 43.4 against 34.3 us, batch 32 x 4k bf16 223.5 against 191.3 us.
    """
    wanted = triton.cdiv(programs_per_multiprocessor * _multiprocessor_count(device),
                         graph_batch(num_seqs) * num_kv_heads)
    return triton.next_power_of_2(wanted)


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


@functools.cache
@functools.lru_cache(maxsize=None)
def _multiprocessor_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2  # interpreter: small, so that tests of the default path still exercise several splits


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def _register_cap(maxnreg: int | None, device: torch.device) -> dict:
    """The launch option that caps a kernel's registers per thread: an NVIDIA GPU's (the interpreter has no
    registers, and ROCm's compiler takes no such option)."""
    return {"maxnreg": maxnreg} if maxnreg and not INTERPRET and device.type == "cuda" and not torch.version.hip \
        else {}


def _same_page_stride(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether K's and V's pages lie alike (a pool's do): the kernels then multiply each page id once."""
    return k_cache.stride(0) == v_cache.stride(0)


def _fp8_scale(cache: torch.Tensor, scale: float) -> float:
    """The dequantization scale the kernels apply: the layer's scale for fp8 caches, 1 for the others."""
    return float(scale) if cache.dtype == FP8_DTYPE else 1.0


def _dot_dtype(query: torch.Tensor, cache: torch.Tensor) -> str:
    """Operand dtype for tl.dot: the query's 16-bit dtype when the cache converts to it exactly, else fp32.

    FP8 caches take fp16 dots: e4m3 -> fp16 is one instruction per pair of elements (-> bf16 adds one per element;
    on an H200 fp16 decode ran 1.2x faster), fp16 holds every e4m3 value and bf16 queries of magnitude 2**-14 to
    65504 exactly, and softmax weights in [0, 1] keep more bits in fp16 than in bf16.
    """
    if query.dtype == torch.float32 or cache.dtype not in (query.dtype, FP8_DTYPE):
        return "fp32"
    if INTERPRET and query.dtype == torch.bfloat16:
        return "fp32"  # the interpreter's tl.dot would multiply bf16 bit patterns as integers
    return "fp16" if cache.dtype == FP8_DTYPE or query.dtype == torch.float16 else "bf16"
