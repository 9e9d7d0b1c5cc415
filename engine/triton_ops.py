"""Triton kernels that fuse a decoder layer's elementwise work, so a decode step launches 6-10 kernels a layer
instead of ~60 (each torch op is a launch; inside a CUDA graph the launches are cheap, but each still costs a
few microseconds of an idle GPU between tiny kernels):

- ``rms_norm``: one program per row; with ``residual`` it first adds it (the residual stream's add) and returns
  the sum too, rounded to the stream's dtype as torch's add would round it.
- ``qk_norm_rope``: per token and head of the fused qkv projection, Qwen3's per-head RMSNorm of q and k and
  rotate-half RoPE at the token's position, written to q and k (v stays a view of qkv), or k and v straight into
  the token's cache slot (the K/V store).
- ``silu_mul``: SwiGLU's ``silu(gate) * up`` over the fused gate_up projection.
- ``skinny_linear``: the linears of a step of few rows, streaming the weight once; it takes SwiGLU in gate_up's
  epilogue (``linear_swiglu``, always), and can take the layer's norm (before qkv and gate_up), SwiGLU (before
  down) and residual add (after o and down) with it, so a few-row step's layer launches 6 kernels
  (``engine.model.decoder_layers``, ``FUSED_LAYERS``).

On sm_90 and later they, like ``engine.triton_attention``'s, launch programmatically dependent (``PDL`` there).

Numerics follow the torch reference (``engine.model``) in float32 and round to the activation dtype where it
does after the norm; RoPE and SwiGLU round once instead of after every op (bf16 results within one ulp). The
same source runs under TRITON_INTERPRET=1 on CPU, whose bf16 downcast truncates: results round to the bf16 grid
in fp32 first (as in ``engine.triton_attention``), so the final cast is exact on both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.triton_attention import INTERPRET, _await_previous_kernel, _pdl_args, _round_to_bf16_grid, _store_rounded

_ROUNDING = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _rounding(dtype: torch.dtype) -> str:
    if dtype not in _ROUNDING:
        raise ValueError(f"fused layer kernels take float32, bfloat16 or float16 activations, got {dtype}")
    return _ROUNDING[dtype]


@triton.jit
def _round(x, ROUND: tl.constexpr):
    """fp32 x rounded to the activation dtype's grid (kept in fp32)."""
    if ROUND == "bf16":
        return _round_to_bf16_grid(x)
    elif ROUND == "fp16":
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, x_stride, res_stride, out_stride, sum_stride,
                     n, eps, HAS_RESIDUAL: tl.constexpr, ROUND: tl.constexpr, BLOCK: tl.constexpr,
                     PDL: tl.constexpr = False):
    _await_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x = _round(x + tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0).to(tl.float32), ROUND)
        tl.store(sum_ptr + row * sum_stride + cols, x.to(sum_ptr.dtype.element_ty), mask=mask)
    inv = tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = _round(w * _round(x * inv, ROUND), ROUND)
    tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(rms_norm(x + residual), x + residual)`` over the last dim (``(rms_norm(x), None)`` without a residual).
    Rows may be strided; the last dim must be contiguous."""
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    if rows.stride(-1) != 1 or weight.shape != (n,):
        raise ValueError(f"rms_norm needs a contiguous last dim and a weight of ({n},), got strides {x.stride()} "
                         f"and weight {tuple(weight.shape)}")
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    total = None
    if residual is not None:
        res = residual.reshape(-1, n)
        total = torch.empty_like(out)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            rows, res if residual is not None else rows, weight, out, total if total is not None else out,
            rows.stride(0), res.stride(0) if residual is not None else 0, out.stride(0),
            total.stride(0) if total is not None else 0, n, float(eps),
            HAS_RESIDUAL=residual is not None, ROUND=_rounding(x.dtype), BLOCK=triton.next_power_of_2(n),
            num_warps=8 if n >= 2048 else 4, **_pdl_args(x.device))
    return out.view(x.shape), None if total is None else total.view(x.shape)


@triton.jit(do_not_specialize_on_alignment=["slot_ptr"])
def _qk_norm_rope_kernel(qkv_ptr, q_ptr, k_ptr, q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, pos_ptr,
                         slot_ptr, k_cache_ptr, v_cache_ptr, k_scale, v_scale,
                         qkv_stride, q_stride, k_stride, cos_stride, stride_kc_page, stride_kc_tok, stride_kc_head,
                         stride_vc_page, stride_vc_tok, stride_vc_head, eps,
                         NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         PAGE_SIZE: tl.constexpr, STORE: tl.constexpr, ROUND: tl.constexpr, PDL: tl.constexpr = False):
    _await_previous_kernel(PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    HALF: tl.constexpr = HEAD_DIM // 2
    offs = tl.arange(0, HALF)
    src = qkv_ptr + token * qkv_stride + head * HEAD_DIM
    x1 = tl.load(src + offs).to(tl.float32)
    x2 = tl.load(src + HALF + offs).to(tl.float32)
    if head < NUM_Q_HEADS:
        w_ptr = q_norm_ptr
        dst = q_ptr + token * q_stride + head * HEAD_DIM
    else:
        w_ptr = k_norm_ptr
        dst = k_ptr + token * k_stride + (head - NUM_Q_HEADS) * HEAD_DIM
    inv = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / HEAD_DIM + eps)
    y1 = _round(tl.load(w_ptr + offs).to(tl.float32) * _round(x1 * inv, ROUND), ROUND)
    y2 = _round(tl.load(w_ptr + HALF + offs).to(tl.float32) * _round(x2 * inv, ROUND), ROUND)
    pos = tl.load(pos_ptr + token)
    # The tables hold [freqs, freqs]: both halves rotate by the first half's angles.
    cos = tl.load(cos_ptr + pos * cos_stride + offs).to(tl.float32)
    sin = tl.load(sin_ptr + pos * cos_stride + offs).to(tl.float32)
    out1 = _round(y1 * cos - y2 * sin, ROUND)
    out2 = _round(y2 * cos + y1 * sin, ROUND)
    if STORE:
        if head >= NUM_Q_HEADS:
            _store_k_v(qkv_ptr + token * qkv_stride, out1, out2, slot_ptr + token, k_cache_ptr, v_cache_ptr, k_scale,
                       v_scale, head - NUM_Q_HEADS, stride_kc_page, stride_kc_tok, stride_kc_head, stride_vc_page,
                       stride_vc_tok, stride_vc_head, NUM_Q_HEADS + NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE)
        else:
            tl.store(dst + offs, out1.to(q_ptr.dtype.element_ty))
            tl.store(dst + HALF + offs, out2.to(q_ptr.dtype.element_ty))
    else:
        tl.store(dst + offs, out1.to(q_ptr.dtype.element_ty))
        tl.store(dst + HALF + offs, out2.to(q_ptr.dtype.element_ty))


@triton.jit
def _store_k_v(qkv_row, k1, k2, slot_ptr, k_cache_ptr, v_cache_ptr, k_scale, v_scale, kv_head, stride_kc_page,
               stride_kc_tok, stride_kc_head, stride_vc_page, stride_vc_tok, stride_vc_head, V_HEAD0: tl.constexpr,
               HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """A token's k head (its halves k1, k2) and the v head beside it in ``qkv_row`` into the token's cache slot, as
    store_kv writes them (slot -1, padding, writes nothing)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    offs = tl.arange(0, HALF)
    slot = tl.load(slot_ptr).to(tl.int64)
    page = tl.maximum(slot, 0) // PAGE_SIZE
    offset = tl.maximum(slot, 0) % PAGE_SIZE
    live = offs < tl.where(slot >= 0, HALF, 0)
    k_dst = k_cache_ptr + page * stride_kc_page + offset * stride_kc_tok + kv_head * stride_kc_head
    _store_rounded(k_dst + offs, k1, k_scale, live)
    _store_rounded(k_dst + HALF + offs, k2, k_scale, live)
    v_src = qkv_row + (V_HEAD0 + kv_head) * HEAD_DIM
    v_dst = v_cache_ptr + page * stride_vc_page + offset * stride_vc_tok + kv_head * stride_vc_head
    _store_rounded(v_dst + offs, tl.load(v_src + offs), v_scale, live)
    _store_rounded(v_dst + HALF + offs, tl.load(v_src + HALF + offs), v_scale, live)


def qk_norm_rope(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, q_norm: torch.Tensor,
                 k_norm: torch.Tensor, eps: float, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 store: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """q ``[T, Hq, D]`` and k ``[T, Hkv, D]`` normed per head and rotated at ``positions``, and v ``[T, Hkv, D]``
    (a view), from the fused projection ``qkv`` ``[T, (Hq + 2 Hkv) * D]``. With ``store`` = ``(k_cache, v_cache,
    slot_mapping, k_scale, v_scale)`` k and v go into the cache slots instead, as ``store_kv`` writes them (slot
    -1 skipped), and only q comes back: ``(q, None, None)``."""
    tokens = qkv.shape[0]
    if qkv.stride(-1) != 1 or qkv.shape[-1] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"qkv must be [T, {(num_heads + 2 * num_kv_heads) * head_dim}] with a contiguous last "
                         f"dim, got {tuple(qkv.shape)} strides {qkv.stride()}")
    if head_dim % 2 or head_dim & (head_dim - 1) or cos.stride(-1) != 1 or cos.stride() != sin.stride():
        raise ValueError(f"qk_norm_rope needs a power-of-two head dim and contiguous cos/sin tables of one "
                         f"layout, got head dim {head_dim}")
    q = torch.empty((tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    k = v = None
    if store is None:
        k = torch.empty((tokens, num_kv_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
        v = qkv[:, (num_heads + num_kv_heads) * head_dim:].unflatten(-1, (num_kv_heads, head_dim))
        k_cache = v_cache = slots = k
        k_scale = v_scale = 1.0
    else:
        k_cache, v_cache, slots, k_scale, v_scale = store
        for cache in (k_cache, v_cache):
            if cache.dim() != 4 or cache.shape[2:] != (num_kv_heads, head_dim) or cache.stride(-1) != 1:
                raise ValueError(f"a cache must be [pages, page_size, {num_kv_heads}, {head_dim}] with a contiguous "
                                 f"last dim, got {tuple(cache.shape)} strides {cache.stride()}")
        if slots.shape != (tokens,):
            raise ValueError(f"slot_mapping must hold one slot per token ({tokens}), got {tuple(slots.shape)}")
    if tokens:
        _qk_norm_rope_kernel[(tokens, num_heads + num_kv_heads)](
            qkv, q, k if k is not None else q, q_norm, k_norm, cos, sin, positions, slots, k_cache, v_cache,
            float(k_scale), float(v_scale), qkv.stride(0), q.stride(0), k.stride(0) if k is not None else 0,
            cos.stride(0), *(k_cache.stride()[:3] if store else (0, 0, 0)),
            *(v_cache.stride()[:3] if store else (0, 0, 0)), float(eps), NUM_Q_HEADS=num_heads,
            NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, PAGE_SIZE=k_cache.shape[1] if store else 1,
            STORE=store is not None, ROUND=_rounding(qkv.dtype), num_warps=1 if head_dim <= 128 else 2,
            **_pdl_args(qkv.device))
    return q, k, v


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, x_stride, out_stride, n, ROUND: tl.constexpr, BLOCK: tl.constexpr,
                     PDL: tl.constexpr = False):
    _await_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + n + cols, mask=mask, other=0.0).to(tl.float32)
    y = _round(gate / (1.0 + tl.exp(-gate)) * up, ROUND)
    tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up`` ``[..., 2 I]`` (gate first) -> ``[..., I]``."""
    n = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * n)
    if rows.stride(-1) != 1:
        raise ValueError(f"silu_mul needs a contiguous last dim, got strides {gate_up.stride()}")
    out = torch.empty((rows.shape[0], n), dtype=gate_up.dtype, device=gate_up.device)
    block = min(triton.next_power_of_2(n), 1024)
    if rows.shape[0]:
        _silu_mul_kernel[(rows.shape[0], triton.cdiv(n, block))](
            rows, out, rows.stride(0), out.stride(0), n, ROUND=_rounding(gate_up.dtype), BLOCK=block, num_warps=4,
            **_pdl_args(gate_up.device))
    return out.view(*gate_up.shape[:-1], n)


# --- few-row linears ----------------------------------------------------------------------------------------------
# A decode step's linears multiply a handful of rows by a weight read once: pure bandwidth. cuBLAS's kernels for
# those shapes stream the weights at 0.58-0.95 of the copy rate, lowest for the square 4096 x 4096 o_proj; this
# kernel (one program per BLOCK_N output columns, looping over K through a pipeline of weight tiles) at 0.66-1.0
# (benchmarks/README.md, "Few-row linears"). It takes up to SKINNY_MAX_ROWS rows, past 16 in a 32-row input tile.
# Alone, at 32 rows it was no faster than cuBLAS; in a graphed step, where it launches programmatically dependent
# (``triton_attention.PDL``) and cuBLAS's kernels do not, an H100 ran Qwen3-8B's decode step 1.05x faster at batch
# 32 and 1.06x at 24 with it than with cuBLAS.
SKINNY_MAX_ROWS = 32
# A few-row step's decoder layers may fold their norms, residual adds and SwiGLU into these linears
# (``engine.model.decoder_layers``); False runs them as kernels of their own (benchmarks compare the two). Off: on
# an H200 (Triton 3.6, Qwen3-8B shape, batch 1) the folded step took 19.0 ms against 4.75 unfused, the SwiGLU
# prologue making down_proj ~8x slower and the norm prologue gate_up ~2.3x (benchmarks/README.md).
FUSED_LAYERS = False
SKINNY_BLOCK_K = 128
# Under programmatic dependent launch (``engine.triton_attention.PDL``) a few-row linear prefetches this many K
# tiles of its weight rows before it waits for the kernel before it (rounded down to a power of two columns); 0
# prefetches nothing.
PREFETCH_STAGES = 4
_SKINNY_DTYPES = (torch.bfloat16, torch.float16)


@triton.jit
def _prefetch_l2(ptrs):
    """Each pointer's 128-byte line on its way into L2 (nothing waits for it)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _dot_acc(acc, x, w, DOT_FP32: tl.constexpr):
    """acc + x @ w.T"""
    if DOT_FP32:       # the interpreter's tl.dot multiplies bf16 bit patterns as integers
        return acc + tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
    return acc + tl.dot(x, tl.trans(w))


@triton.jit(do_not_specialize=["M"])
def _skinny_linear_kernel(x_ptr, w_ptr, out_ptr, g_ptr, res_ptr, M, N, K, x_stride, w_stride, out_stride, res_stride,
                          eps, PROLOGUE: tl.constexpr, RESIDUAL: tl.constexpr, ROUND: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr,
                          PDL: tl.constexpr = False, PREFETCH_K: tl.constexpr = 0, SWIGLU: tl.constexpr = False):
    rows = tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    if PDL and PREFETCH_K > 0:
        # The weight's first PREFETCH_K columns of this program's rows (nothing writes them) head for L2 while the
        # kernel before this one ends; the pipeline's first loads then find them there.
        lines = tl.arange(0, PREFETCH_K // 64) * 64        # a 128-byte line holds 64 16-bit weights
        ahead = w_ptr + tl.minimum(cols, N - 1)[:, None].to(tl.int64) * w_stride + lines[None, :]
        _prefetch_l2(ahead)
        if SWIGLU:
            _prefetch_l2(ahead + N * w_stride)                # and the matching up rows
    _await_previous_kernel(PDL)
    ks = tl.arange(0, BLOCK_K)
    # Masks vary by row only (K is a multiple of BLOCK_K), so the weight tiles load as wide vectors.
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * x_stride + ks[None, :]
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * w_stride + ks[None, :]
    row_mask = rows[:, None] < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    up_acc = tl.zeros((BLOCK_M, BLOCK_N) if SWIGLU else (1, 1), tl.float32)   # SWIGLU: up's rows, N below gate's
    squares = tl.zeros((BLOCK_M,), tl.float32)
    for k in range(0, K, BLOCK_K):
        if PROLOGUE == "norm":     # x is the residual stream: RMSNorm's weight now, its 1/rms once the sum is done
            h = tl.load(x_ptrs, mask=row_mask, other=0.0).to(tl.float32)
            squares += tl.sum(h * h, axis=1)
            x = _round(h * tl.load(g_ptr + k + ks).to(tl.float32)[None, :], ROUND).to(w_ptr.dtype.element_ty)
        elif PROLOGUE == "silu":   # x is the fused gate_up projection: SwiGLU as silu_mul rounds it
            gate = tl.load(x_ptrs, mask=row_mask, other=0.0).to(tl.float32)
            up = tl.load(x_ptrs + K, mask=row_mask, other=0.0).to(tl.float32)
            x = _round(gate / (1.0 + tl.exp(-gate)) * up, ROUND).to(w_ptr.dtype.element_ty)
        else:
            x = tl.load(x_ptrs, mask=row_mask, other=0.0)
        w = tl.load(w_ptrs, mask=cols[:, None] < N, other=0.0)
        acc = _dot_acc(acc, x, w, DOT_FP32)
        if SWIGLU:
            up_acc = _dot_acc(up_acc, x, tl.load(w_ptrs + N * w_stride, mask=cols[:, None] < N, other=0.0), DOT_FP32)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if PROLOGUE == "norm":
        acc = acc * tl.rsqrt(squares / K + eps)[:, None]
    out = _round(acc, ROUND)
    if SWIGLU:                 # SwiGLU of the rounded gate and up, as silu_mul takes them from the gate_up product
        out = _round(out / (1.0 + tl.exp(-out)) * _round(up_acc, ROUND), ROUND)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    if RESIDUAL:               # the residual stream's add, rounded as torch's add of the rounded product
        out = _round(out + tl.load(res_ptr + rows[:, None].to(tl.int64) * res_stride + cols[None, :], mask=mask,
                                   other=0.0).to(tl.float32), ROUND)
    tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def skinny_block_m(rows: int) -> int:
    """Rows of the few-row kernel's input tile: 16 (the least a tensor-core product takes), or 32 past 16 rows."""
    return 16 if rows <= 16 else 32


def skinny_fits(rows: int, weight: torch.Tensor, x_dtype: torch.dtype) -> bool:
    """Whether ``linear`` takes the few-row kernel for ``rows`` rows of ``x_dtype`` times ``weight`` ``[N, K]``."""
    return (weight.is_cuda and 1 <= rows <= SKINNY_MAX_ROWS and x_dtype in _SKINNY_DTYPES
            and weight.dtype == x_dtype and weight.dim() == 2 and weight.stride(-1) == 1
            and weight.shape[1] % SKINNY_BLOCK_K == 0)


def _skinny_tiles(n: int, k: int, device: torch.device, x_tiles: int = 1, swiglu: bool = False, block_m: int = 16
                  ) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, stages), from a sweep on an H100 and an H200 (benchmarks/README.md): weights of 16k+
    rows take 64-column tiles 3 deep, others 32 columns 6 deep, 256 wide along a long K (one program per
    multiprocessor at 4096 columns); as many stages as the device's shared memory holds, each holding the weight's
    tile and ``x_tiles`` input tiles of ``block_m`` rows (2 for SwiGLU's gate and up). With the SwiGLU epilogue
    (``swiglu``) a program's weight tile is BLOCK_N rows of gate and as many of up: half the output columns, the
    same bytes."""
    rows, stages = (64, 3) if n >= 16384 else (32, 6)
    block_k = 256 if k >= 8192 and k % 256 == 0 else SKINNY_BLOCK_K
    stage_bytes = (block_m * x_tiles + rows) * block_k * 2
    return rows // 2 if swiglu else rows, block_k, max(2, min(stages, (_shared_memory(device) - 8192) // stage_bytes))


_SHARED_MEMORY: dict[int, int] = {}


def _shared_memory(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SHARED_MEMORY:
        props = triton.runtime.driver.active.utils.get_device_properties(index)
        _SHARED_MEMORY[index] = props["max_shared_mem"]
    return _SHARED_MEMORY[index]


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, tiles: tuple[int, int, int] | None = None, *,
                  norm: torch.Tensor | None = None, eps: float = 0.0, silu: bool = False, swiglu: bool = False,
                  residual: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T`` through the few-row kernel (``x`` ``[..., K]``, at most ``SKINNY_MAX_ROWS`` rows;
    ``weight`` ``[N, K]`` with K a multiple of ``SKINNY_BLOCK_K``), fp32 accumulation rounded once to x's dtype.
    A decoder layer's elementwise work folds in, so it needs no kernel of its own:

    - ``norm`` (``[K]``): the product of ``rms_norm(x) * norm`` (``eps`` inside the root), x being the residual
      stream; the weight applies to each K tile, the 1/rms to the sums, so x is read once;
    - ``silu``: x is the fused gate_up ``[..., 2 K]`` and the product is of ``silu(gate) * up``, rounded as
      ``silu_mul`` rounds it;
    - ``swiglu``: the weight is the fused gate_up ``[2 I, K]`` and the result ``silu(gate) * up`` ``[..., I]``
      (``silu_mul`` of the product, to the bit): each program multiplies by its columns' gate and up rows;
    - ``residual`` (``[..., N]``, ``[..., I]`` with ``swiglu``): the rounded result plus it, rounded as the
      residual stream's add rounds.

    ``tiles`` (BLOCK_N, BLOCK_K, stages) overrides ``_skinny_tiles`` (tests on CPU)."""
    n, k = weight.shape
    if swiglu and n % 2:
        raise ValueError(f"swiglu takes a gate_up weight of 2 I rows, got {n}")
    n = n // 2 if swiglu else n
    width = 2 * k if silu else k
    rows = x.reshape(-1, width)
    if (rows.stride(-1) != 1 or weight.stride(-1) != 1 or k % SKINNY_BLOCK_K or rows.shape[0] > SKINNY_MAX_ROWS
            or x.shape[-1] != width):
        raise ValueError(f"skinny_linear takes at most {SKINNY_MAX_ROWS} rows of {width} with contiguous last dims "
                         f"and K a multiple of {SKINNY_BLOCK_K}, got x {tuple(x.shape)} strides {x.stride()} and "
                         f"weight {tuple(weight.shape)} strides {weight.stride()}")
    if norm is not None and (silu or norm.shape != (k,) or norm.stride(-1) != 1):
        raise ValueError(f"the norm's weight must be ({k},) and contiguous, and not with silu; got "
                         f"{tuple(norm.shape)} (silu={silu})")
    res = None
    if residual is not None:
        res = residual.reshape(-1, n)
        if res.shape[0] != rows.shape[0] or res.stride(-1) != 1:
            raise ValueError(f"the residual must be {rows.shape[0]} contiguous rows of {n}, got "
                             f"{tuple(residual.shape)} strides {residual.stride()}")
    out = torch.empty((rows.shape[0], n), dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        block_m = skinny_block_m(rows.shape[0])
        block_n, block_k, stages = tiles or _skinny_tiles(weight.shape[0], k, x.device, 2 if silu else 1, swiglu,
                                                          block_m)
        if k % block_k:
            raise ValueError(f"K {k} is not a multiple of the K tile {block_k}")
        launch = _pdl_args(x.device)
        if launch and PREFETCH_STAGES:      # a power of two columns, at least one K tile
            launch["PREFETCH_K"] = 1 << (min(k, PREFETCH_STAGES * block_k).bit_length() - 1)
        _skinny_linear_kernel[(triton.cdiv(n, block_n),)](
            rows, weight, out, norm if norm is not None else weight, res if res is not None else out,
            rows.shape[0], n, k, rows.stride(0), weight.stride(0), out.stride(0), res.stride(0) if res is not None
            else 0, float(eps), PROLOGUE="norm" if norm is not None else "silu" if silu else "none",
            RESIDUAL=res is not None, ROUND=_rounding(x.dtype), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            DOT_FP32=INTERPRET and x.dtype == torch.bfloat16, SWIGLU=swiglu, num_stages=stages, num_warps=4,
            **launch)
    return out.view(*x.shape[:-1], n)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)``, through the few-row kernel where it applies (``skinny_fits``)."""
    if skinny_fits(x.numel() // x.shape[-1] if x.shape[-1] else 0, weight, x.dtype) and x.stride(-1) == 1:
        return skinny_linear(x, weight)
    return torch.nn.functional.linear(x, weight)


def linear_swiglu(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """``silu_mul(F.linear(x, gate_up))``, through the few-row kernel's SwiGLU epilogue where it applies: one kernel
    instead of two, and no gate_up product in memory."""
    if skinny_fits(x.numel() // x.shape[-1] if x.shape[-1] else 0, gate_up, x.dtype) and x.stride(-1) == 1:
        return skinny_linear(x, gate_up, swiglu=True)
    return silu_mul(torch.nn.functional.linear(x, gate_up))


def precompile_linears(weights, dtype: torch.dtype, fused=()) -> int:
    """Launch the few-row kernel once for each of ``weights``' shapes, and for each ``(weight, keywords)`` of
    ``fused`` (``engine.model.fused_linears``) with that fused work (before serving: a variant met later would
    compile inside a step). Returns the variants launched."""
    launched = set()
    # A row count for each input tile the kernel takes up to SKINNY_MAX_ROWS rows.
    row_counts = sorted({min(skinny_block_m(r), SKINNY_MAX_ROWS) for r in range(1, SKINNY_MAX_ROWS + 1)})
    for weight, kw in [(w, {}) for w in weights] + list(fused):
        for rows in row_counts:
            key = (tuple(weight.shape), weight.stride(0), tuple(sorted(kw)), skinny_block_m(rows))
            if skinny_fits(rows, weight, dtype) and key not in launched:
                launched.add(key)
                n, k = weight.shape
                x = torch.zeros(rows, 2 * k if kw.get("silu") else k, dtype=dtype, device=weight.device)
                out_n = n // 2 if kw.get("swiglu") else n
                skinny_linear(x, weight, norm=kw.get("norm"), eps=1e-6, silu=kw.get("silu", False),
                              swiglu=kw.get("swiglu", False),
                              residual=torch.zeros(rows, out_n, dtype=dtype, device=weight.device)
                              if kw.get("residual") else None)
    return len(launched)
