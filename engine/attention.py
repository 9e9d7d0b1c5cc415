"""Paged attention over the unified KV cache: the public API, a plain-torch reference path, and backend dispatch.

Cache layout per layer: K and V views of shape [num_pages, page_size, num_kv_heads, head_dim], the head dim
contiguous. A page is head-major in memory (``kv.pool``: [kv_heads, page_size, head_dim]) or token-major
([page_size, kv_heads, head_dim]); the page dim has whatever stride the page-major group buffer gives it. Nothing
here assumes either layout or ``stride(0)``, and nothing ever copies a cache. FP8 layers (float8_e4m3fn) carry a
per-layer scale: stored = clamp(x / scale, +-448) cast to fp8, loaded = stored * scale. Other dtypes ignore it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn value
CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, FP8_DTYPE)


@dataclass
class AttentionMetadata:
    """Where each sequence's queries sit in the flattened batch and where its K/V sit in the pages."""

    query_start_loc: torch.Tensor  # int32 [B+1], cumulative query lengths of the flattened batch
    seq_lens: torch.Tensor  # int32 [B], kv length of each sequence INCLUDING this step's tokens (already stored)
    block_tables: torch.Tensor  # int32 [B, max_pages_per_seq], page ids; unused entries are 0 or -1
    slot_mapping: torch.Tensor  # int64 [T], flat slot = page_id*page_size + offset per query token; -1 = do not store
    max_query_len: int
    max_seq_len: int
    causal: bool = True
    backend: str = "torch"  # "torch" | "triton"
    # Every row has the same query length. A batch of rows of several lengths (prefill chunks beside decode and
    # verification rows) takes the Triton varlen kernel at its largest query tile whatever max_query_len is, as a
    # ragged CUDA graph (``engine.cuda_graphs.RaggedGraphs``, whose max_query_len is its padded token count) must:
    # the same rows then get the same numbers graphed or not.
    uniform: bool = True


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    backend: str = "torch",
) -> None:
    """Write key/value [T, Hkv, D] into the caches in place at slot_mapping, quantizing fp8; slots of -1 skipped."""
    _check_cache(k_cache, v_cache)
    if backend == "triton":
        _triton().store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    elif backend == "torch":
        _store_torch(key, k_cache, slot_mapping, k_scale)
        _store_torch(value, v_cache, slot_mapping, v_scale)
    else:
        raise ValueError(f"unknown attention backend {backend!r}; expected 'torch' or 'triton'")


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Attention of query [T, Hq, D] over each sequence's paged K/V; returns [T, Hq, D] in query.dtype.

    Rows past query_start_loc[-1] (batch padding) are left unwritten.
    """
    _check_cache(k_cache, v_cache)
    if query.shape[1] % k_cache.shape[2] != 0:
        raise ValueError(f"query heads {query.shape[1]} are not a multiple of kv heads {k_cache.shape[2]}")
    if meta.backend == "triton":
        triton_attention = _triton()
        # One query, or a short block in a small batch, per sequence (decode; verification and drafter blocks):
        # split each sequence's KV over several programs, or a small batch leaves most of the GPU idle. Longer
        # blocks (prefill chunks, mixed batches) and large batches of short ones take the varlen kernel.
        if meta.uniform and triton_attention.prefers_split_kv(meta.max_query_len, meta.seq_lens.shape[0],
                                                              query.shape[1], k_cache.shape[2], query.device):
            return triton_attention.decode_attention(query, k_cache, v_cache, meta, scale, k_scale, v_scale)
        return triton_attention.varlen_attention(query, k_cache, v_cache, meta, scale, k_scale, v_scale)
    if meta.backend == "torch":
        return _attention_torch(query, k_cache, v_cache, meta, scale, k_scale, v_scale)
    raise ValueError(f"unknown attention backend {meta.backend!r}; expected 'torch' or 'triton'")


def quantize_for_cache(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Convert x to the cache's storage dtype: fp8 divides by the scale and saturates, others just cast."""
    if cache_dtype != FP8_DTYPE:
        return x.to(cache_dtype)
    # The fp32 quotient, correctly rounded on every device: float64 division rounded once to float32 is exactly
    # IEEE fp32 division (53 >= 2*24 + 2 bits), which the Triton store kernel does too. A device tensor as the
    # divisor, because CUDA torch turns `x / python_float` into x * (1/scale), which rounds differently.
    divisor = torch.tensor(float(torch.tensor(scale, dtype=torch.float32)), dtype=torch.float64, device=x.device)
    return (x.double() / divisor).float().clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_from_cache(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Float32 values of cache entries: fp8 entries are multiplied by the scale, others only upcast."""
    return x.float() * scale if x.dtype == FP8_DTYPE else x.float()


def _store_torch(x: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, scale: float) -> None:
    page_size = cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    # Index (page, offset) rather than flattening: a strided page dim cannot be viewed as one flat token dim.
    values = quantize_for_cache(x[keep], cache.dtype, scale)
    _indexable(cache)[slots // page_size, slots % page_size] = _indexable(values)


def _gather_tokens(cache: torch.Tensor, pages: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The first num_tokens rows [num_tokens, H, D] of the given pages, in page order."""
    return _indexable(cache)[pages].flatten(0, 1)[:num_tokens].view(cache.dtype)


def _indexable(x: torch.Tensor) -> torch.Tensor:
    # fp8 goes through gather/scatter as raw bytes: not every torch build indexes float8 tensors on every device.
    return x.view(torch.uint8) if x.dtype == FP8_DTYPE else x


# Batches whose rows are all at most this many queries (decode, verification, drafter blocks) are padded and
# computed in one batched op; longer rows (prefill chunks) go one sequence at a time.
_BATCHED_MAX_QUERY_LEN = 32


def _attention_torch(query, k_cache, v_cache, meta, scale, k_scale, v_scale) -> torch.Tensor:
    if meta.max_query_len <= _BATCHED_MAX_QUERY_LEN:
        return _attention_torch_batched(query, k_cache, v_cache, meta, scale, k_scale, v_scale)
    return _attention_torch_per_sequence(query, k_cache, v_cache, meta, scale, k_scale, v_scale)


def _attention_torch_batched(query, k_cache, v_cache, meta, scale, k_scale, v_scale) -> torch.Tensor:
    """Every sequence padded to the longest query row and the longest context, masked, in one einsum."""
    num_q_heads, head_dim = query.shape[1], query.shape[2]
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    batch = meta.seq_lens.numel()
    q_len_max, s_max = meta.max_query_len, meta.max_seq_len
    starts = meta.query_start_loc.long()
    q_lens = starts[1:] - starts[:-1]
    seq_lens = meta.seq_lens.long()
    device = query.device
    # Flat query index of (row b, slot i); padded slots point at row 0 and are dropped at the end.
    slot = torch.arange(q_len_max, device=device)
    valid_q = slot[None, :] < q_lens[:, None]
    flat = torch.where(valid_q, starts[:-1, None] + slot[None, :], 0)
    q = query[flat].float().view(batch, q_len_max, num_kv_heads, group, head_dim)
    pages = meta.block_tables[:, : -(-s_max // page_size)].long().clamp_min(0)

    def gather(cache, cache_scale):
        x = _indexable(cache)[pages].view(cache.dtype)               # [B, P, page, H, D]
        return dequantize_from_cache(x.flatten(1, 2)[:, :s_max], cache_scale)
    k, v = gather(k_cache, k_scale), gather(v_cache, v_scale)     # [B, S, H, D]
    scores = torch.einsum("bqhgd,bshd->bhgqs", q, k) * scale
    k_pos = torch.arange(s_max, device=device)
    visible = k_pos[None, None, :] < seq_lens[:, None, None]           # [B, 1, S]
    if meta.causal:
        q_pos = seq_lens[:, None] - q_lens[:, None] + slot[None, :]    # [B, Q]
        visible = visible & (k_pos[None, None, :] <= q_pos[:, :, None])
    scores.masked_fill_(~visible[:, None, None], float("-inf"))
    probs = scores.softmax(dim=-1).nan_to_num_(0.0)                      # padded query rows see nothing
    o = torch.einsum("bhgqs,bshd->bqhgd", probs, v).reshape(batch, q_len_max, num_q_heads, head_dim)
    out = torch.empty_like(query)
    out[flat[valid_q]] = o[valid_q].to(query.dtype)
    return out


def _attention_torch_per_sequence(query, k_cache, v_cache, meta, scale, k_scale, v_scale) -> torch.Tensor:
    """Reference: per sequence, gather its pages, then float32 masked softmax attention with GQA."""
    num_tokens, num_q_heads, head_dim = query.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(query)
    starts = meta.query_start_loc.tolist()
    for b, seq_len in enumerate(meta.seq_lens.tolist()):
        q_begin, q_end = starts[b], starts[b + 1]
        q_len = q_end - q_begin
        if q_len == 0:
            continue
        pages = meta.block_tables[b, : -(-seq_len // page_size)].long()
        k = dequantize_from_cache(_gather_tokens(k_cache, pages, seq_len), k_scale)  # [S, Hkv, D]
        v = dequantize_from_cache(_gather_tokens(v_cache, pages, seq_len), v_scale)
        q = query[q_begin:q_end].float().view(q_len, num_kv_heads, group, head_dim)
        scores = torch.einsum("qhgd,shd->hgqs", q, k) * scale
        if meta.causal:
            # Query i sits at absolute position seq_len - q_len + i and sees keys at positions <= its own.
            q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
            k_pos = torch.arange(seq_len, device=query.device)
            scores.masked_fill_(k_pos[None, :] > q_pos[:, None], float("-inf"))
        probs = scores.softmax(dim=-1)
        o = torch.einsum("hgqs,shd->qhgd", probs, v)
        out[q_begin:q_end] = o.reshape(q_len, num_q_heads, head_dim).to(query.dtype)
    return out


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dim() != 4 or cache.dtype not in CACHE_DTYPES:
            raise ValueError(f"{name} must be [pages, page_size, kv_heads, head_dim] of {CACHE_DTYPES}, "
                             f"got {tuple(cache.shape)} {cache.dtype}")
        _, page_size, heads, dim = cache.shape
        if cache.stride()[1:] not in ((dim, page_size * dim, 1), (heads * dim, dim, 1)):
            raise ValueError(f"{name}'s pages must be head-major or token-major with a contiguous head dim, got "
                             f"strides {cache.stride()} for shape {tuple(cache.shape)}")


def _triton():
    # Imported on first use so the torch path never needs Triton, and tests can set TRITON_INTERPRET first.
    from engine import triton_attention

    return triton_attention
