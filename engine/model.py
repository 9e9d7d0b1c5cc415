"""Qwen3 target model over the paged KV cache (RMSNorm, GQA with q/k norm, RoPE, SwiGLU)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.attention import AttentionMetadata, paged_attention, store_kv
from engine.checkpoint import CheckpointError, Qwen3Config, load_tensors, read_config, take
from engine.parallel import ShardPlan, TensorParallel, active


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                 backend: str = "torch") -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(rms_norm(residual + x), residual + x)``, or ``(rms_norm(x), None)`` without a residual; the Triton
    backend fuses the add and the norm into one kernel."""
    if backend == "triton":
        from engine import triton_ops

        return triton_ops.rms_norm(x, weight, eps, residual)
    if residual is not None:
        x = residual + x
    return rms_norm(x, weight, eps), (x if residual is not None else None)


def linear(x: torch.Tensor, weight: torch.Tensor, backend: str = "torch") -> torch.Tensor:
    """``F.linear(x, weight)``; the Triton backend takes a few-row kernel for the short steps' rows on a GPU
    (``triton_ops.linear``), where cuBLAS's kernels stream the weights below the copy rate."""
    if backend == "triton":
        from engine import triton_ops

        return triton_ops.linear(x, weight)
    return F.linear(x, weight)


def rope_table(head_dim: int, theta: float, max_positions: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos/sin ``[max_positions, head_dim]`` of rotate-half RoPE."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    t = torch.arange(max_positions, dtype=torch.float32, device=device)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[..., T, heads, head_dim]`` rotated at ``positions`` ``[..., T]`` from a ``rope_table``."""
    cos = cos[positions].unsqueeze(-2)
    sin = sin[positions].unsqueeze(-2)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class RotaryEmbedding:
    """Rotate-half RoPE with a cos/sin table precomputed for every position."""

    def __init__(self, head_dim: int, theta: float, max_positions: int, device, dtype):
        cos, sin = rope_table(head_dim, theta, max_positions, device)
        self.cos = cos.to(dtype)
        self.sin = sin.to(dtype)
        self.max_positions = max_positions

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim] rotated at ``positions`` [T]."""
        return apply_rope(x, positions, self.cos, self.sin)


@dataclass
class LayerKV:
    """One layer's cache views and FP8 scales, as the attention functions take them."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_scale: float = 1.0
    v_scale: float = 1.0


def attention_heads(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, q_norm: torch.Tensor,
                    k_norm: torch.Tensor, eps: float, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    backend: str, kv: LayerKV | None = None, slot_mapping: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """q ``[..., T, num_heads, D]``, k and v ``[..., T, Hkv, D]`` of a fused projection ``qkv`` ``[..., T,
    (num_heads + 2 Hkv) * D]`` (``num_heads``: all of a layer's q heads, or none): Qwen3's per-head RMSNorm of q and
    k, rotate-half RoPE at ``positions``. With ``kv`` k and v go into its pages at ``slot_mapping`` instead (as
    ``store_kv`` writes them) and ``(q, None, None)`` comes back; the Triton backend does it all in one kernel."""
    if backend == "triton":
        from engine import triton_ops

        store = None if kv is None else (kv.k_cache, kv.v_cache, slot_mapping, kv.k_scale, kv.v_scale)
        return triton_ops.qk_norm_rope(qkv, num_heads, num_kv_heads, head_dim, q_norm, k_norm, eps, positions, cos,
                                       sin, store)
    kv_dim = num_kv_heads * head_dim
    q, k, v = qkv.split([num_heads * head_dim, kv_dim, kv_dim], dim=-1)
    q = q.unflatten(-1, (num_heads, head_dim))
    if num_heads:
        q = apply_rope(rms_norm(q, q_norm, eps), positions, cos, sin)
    k = apply_rope(rms_norm(k.unflatten(-1, (num_kv_heads, head_dim)), k_norm, eps), positions, cos, sin)
    v = v.unflatten(-1, (num_kv_heads, head_dim))
    if kv is None:
        return q, k, v
    store_kv(k, v, kv.k_cache, kv.v_cache, slot_mapping, kv.k_scale, kv.v_scale, backend=backend)
    return q, None, None


@dataclass(frozen=True)
class AttentionSite:
    """What the attention kernels of a model's layers are compiled for: their query heads (this rank's), one
    layer's caches (every layer of the model has the same dtypes and shapes), and whether attention is causal."""

    num_q_heads: int
    kv: LayerKV
    query_dtype: torch.dtype
    causal: bool


@dataclass
class DecoderLayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor          # [(Hq + 2 Hkv) * D, H]: one matmul for q, k and v
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor      # [2 I, H]
    down: torch.Tensor


def load_decoder_layer(tensors: dict, prefix: str, hidden: int, heads: int, kv_heads: int, head_dim: int,
                       intermediate: int, source: str) -> DecoderLayerWeights:
    """The weights of one Qwen3 decoder layer (shared by the target and the DFlash drafter)."""
    def t(name, shape):
        return take(tensors, prefix + name, shape, source)
    q = t("self_attn.q_proj.weight", (heads * head_dim, hidden))
    k = t("self_attn.k_proj.weight", (kv_heads * head_dim, hidden))
    v = t("self_attn.v_proj.weight", (kv_heads * head_dim, hidden))
    gate = t("mlp.gate_proj.weight", (intermediate, hidden))
    up = t("mlp.up_proj.weight", (intermediate, hidden))
    return DecoderLayerWeights(
        input_norm=t("input_layernorm.weight", (hidden,)),
        qkv=torch.cat([q, k, v], dim=0),
        q_norm=t("self_attn.q_norm.weight", (head_dim,)),
        k_norm=t("self_attn.k_norm.weight", (head_dim,)),
        o=t("self_attn.o_proj.weight", (hidden, heads * head_dim)),
        post_norm=t("post_attention_layernorm.weight", (hidden,)),
        gate_up=torch.cat([gate, up], dim=0),
        down=t("mlp.down_proj.weight", (hidden, intermediate)),
    )


def swiglu_mlp(x: torch.Tensor, w: DecoderLayerWeights, backend: str = "torch") -> torch.Tensor:
    if backend == "triton":
        from engine import triton_ops

        return linear(triton_ops.linear_swiglu(x, w.gate_up), w.down, backend)
    gate, up = F.linear(x, w.gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w.down)


# Receives (layer index, the layer's weights, its qkv projection ``[T, (Hq + 2 Hkv) * D]``) and returns the
# attention output ``[T, Hq * D]`` before o_proj.
LayerAttention = Callable[[int, DecoderLayerWeights, torch.Tensor], torch.Tensor]


def fuses_layers(layers: Sequence[DecoderLayerWeights], rows: int, dtype: torch.dtype, backend: str,
                 reduce: Callable | None) -> bool:
    """Whether ``decoder_layers`` folds each layer's norms, residual adds and SwiGLU into its linears (the few-row
    kernel's prologue and epilogue): a step of few half-precision rows on the Triton backend, on one rank (the
    residual add comes after a TP all-reduce)."""
    if backend != "triton" or reduce is not None or not layers:
        return False
    from engine import triton_ops

    first = layers[0]
    return triton_ops.FUSED_LAYERS and all(triton_ops.skinny_fits(rows, w, dtype)
                                           for w in (first.qkv, first.o, first.gate_up, first.down))


def decoder_layers(h: torch.Tensor, layers: Sequence[DecoderLayerWeights], attention: LayerAttention, eps: float,
                   backend: str, reduce: Callable | None = None, capture: Sequence[int] = ()
                   ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """The pre-norm residual stream ``h`` ``[T, H]`` through ``layers`` (the target's and the drafter's): the
    last layer's output, before the final norm, and the stream after each layer of ``capture``. ``reduce`` sums a
    row-parallel linear's partial outputs over TP ranks (None: one rank).

    A few-row step on the Triton backend (``fuses_layers``) runs 4 linears a layer and no norm or SwiGLU kernel:
    qkv and gate_up norm the stream as they read it, o_proj and down_proj add their product to it, down_proj takes
    SwiGLU of the gate_up projection as it reads it."""
    captured = {}
    if fuses_layers(layers, h.numel() // h.shape[-1], h.dtype, backend, reduce):
        from engine.triton_ops import skinny_linear

        for i, layer in enumerate(layers):
            qkv = skinny_linear(h, layer.qkv, norm=layer.input_norm, eps=eps)
            h = skinny_linear(attention(i, layer, qkv), layer.o, residual=h)
            gate_up = skinny_linear(h, layer.gate_up, norm=layer.post_norm, eps=eps)
            h = skinny_linear(gate_up, layer.down, silu=True, residual=h)
            if i in capture:
                captured[i] = h
        return h, captured
    reduce = reduce or (lambda x: x)
    # Each norm takes the residual add before it (one fused kernel on the Triton backend).
    x, _ = add_rms_norm(h, layers[0].input_norm, eps, backend=backend)
    for i, layer in enumerate(layers):
        out = reduce(linear(attention(i, layer, linear(x, layer.qkv, backend)), layer.o, backend))
        x, h = add_rms_norm(out, layer.post_norm, eps, h, backend)
        mlp = reduce(swiglu_mlp(x, layer, backend))
        if i + 1 < len(layers):
            x, h = add_rms_norm(mlp, layers[i + 1].input_norm, eps, h, backend)
        else:
            h = h + mlp
        if i in capture:
            captured[i] = h
    return h, captured


def fused_linears(layers: Sequence[DecoderLayerWeights], tp: bool) -> list[tuple[torch.Tensor, dict]]:
    """Each linear of ``layers`` with the fused work ``decoder_layers`` gives it in a few-row step
    (``skinny_linear``'s keywords, ``residual=True`` for a residual add), for compiling before serving: the
    layers' norms, adds and SwiGLU with ``triton_ops.FUSED_LAYERS`` on one rank (``tp`` False), else gate_up's
    SwiGLU epilogue (``swiglu_mlp``)."""
    from engine import triton_ops

    if not triton_ops.FUSED_LAYERS or tp:
        return [(layer.gate_up, {"swiglu": True}) for layer in layers]
    return [use for layer in layers for use in ((layer.qkv, {"norm": layer.input_norm}), (layer.o, {"residual": True}),
                                                (layer.gate_up, {"norm": layer.post_norm}),
                                                (layer.down, {"silu": True, "residual": True}))]


def shard_plan(config: Qwen3Config, tp: TensorParallel | None) -> ShardPlan:
    """The target's share on ``tp``'s rank (the whole model without TP); refuses a TP size that does not split it."""
    c = config
    size, rank = (tp.size, tp.rank) if tp is not None else (1, 0)
    return ShardPlan(size, rank, heads=c.num_attention_heads, kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
                     intermediate=c.intermediate_size, vocab=c.vocab_size, who="the target model")


class Qwen3Model:
    """The target: embeddings, decoder layers over paged K/V, final norm and LM head.

    Under tensor parallelism (``tp``) ``tensors`` are this rank's shards (``shard_plan``): attention heads, MLP
    columns and vocab rows; o_proj, down_proj and the embedding all-reduce, the LM head all-gathers.
    """

    def __init__(self, config: Qwen3Config, tensors: dict[str, torch.Tensor], device, dtype, source: str,
                 tp: TensorParallel | None = None):
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        self.tp = active(tp)
        c = config
        plan = shard_plan(c, self.tp)
        self.num_heads, self.num_kv_heads = plan.num_heads, plan.num_kv_heads
        vocab = plan.vocab_per_rank if self.tp else c.vocab_size
        self.vocab_start = plan.vocab_start
        self.embed_tokens = take(tensors, "model.embed_tokens.weight", (vocab, c.hidden_size), source)
        if c.tie_word_embeddings or "lm_head.weight" not in tensors:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = take(tensors, "lm_head.weight", (vocab, c.hidden_size), source)
        self.norm = take(tensors, "model.norm.weight", (c.hidden_size,), source)
        self.layers = [
            load_decoder_layer(tensors, f"model.layers.{i}.", c.hidden_size, plan.num_heads, plan.num_kv_heads,
                               c.head_dim, plan.intermediate_size, source)
            for i in range(c.num_hidden_layers)
        ]
        self.rope = RotaryEmbedding(c.head_dim, c.rope_theta, c.max_position_embeddings, self.device, dtype)
        self.scale = c.head_dim ** -0.5

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, device="cpu", dtype: torch.dtype = torch.float32,
                        tp: TensorParallel | None = None) -> "Qwen3Model":
        """Load a checkpoint; under ``tp`` only this rank's shard of each tensor is read."""
        raw = read_config(model_dir)
        archs = raw.get("architectures") or []
        if raw.get("model_type") not in (None, "qwen3") and "Qwen3ForCausalLM" not in archs:
            raise CheckpointError(f"{model_dir}: expected a Qwen3 model, got model_type {raw.get('model_type')!r}")
        config = Qwen3Config.from_dict(raw, f"{model_dir}/config.json")
        tp = active(tp)
        plan = shard_plan(config, tp)        # a TP size that does not split the model fails before any read
        tensors = load_tensors(model_dir, dtype, device, shard=plan.shard if tp else None)
        return cls(config, tensors, device, dtype, str(model_dir), tp)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return F.embedding(input_ids, self.embed_tokens)
        # Vocab-parallel: each rank embeds the ids of its vocab rows, zeros elsewhere; the sum is the embedding.
        ids = input_ids - self.vocab_start
        outside = (ids < 0) | (ids >= self.embed_tokens.shape[0])
        h = F.embedding(ids.masked_fill(outside, 0), self.embed_tokens)
        return self.tp.all_reduce(h.masked_fill_(outside.unsqueeze(-1), 0))

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of a row-parallel layer's partial output (``x`` itself without TP)."""
        return x if self.tp is None else self.tp.all_reduce(x)

    def lm_logits(self, normed: torch.Tensor, backend: str = "torch") -> torch.Tensor:
        """float32 logits ``[..., V]`` of final-normed hidden states (the drafter's too), on every rank."""
        logits = linear(normed, self.lm_head, backend)
        if self.tp is not None:
            logits = self.tp.all_gather_vocab(logits, self.config.vocab_size)
        return logits.float()

    def compute_logits(self, hidden: torch.Tensor, backend: str = "torch") -> torch.Tensor:
        """Logits in float32 from final (un-normed) hidden states."""
        return self.lm_logits(add_rms_norm(hidden, self.norm, self.config.rms_norm_eps, backend=backend)[0], backend)

    def attention(self, layer: DecoderLayerWeights, qkv: torch.Tensor, positions: torch.Tensor, kv: LayerKV,
                  meta: AttentionMetadata) -> torch.Tensor:
        """A layer's attention output ``[T, Hq * D]`` (before o_proj) from its qkv projection: q and k normed and
        rotated, k and v stored in the pages, attention over them."""
        c = self.config
        q, _, _ = attention_heads(qkv, self.num_heads, self.num_kv_heads, c.head_dim, layer.q_norm, layer.k_norm,
                                  c.rms_norm_eps, positions, self.rope.cos, self.rope.sin, meta.backend, kv,
                                  meta.slot_mapping)
        return paged_attention(q, kv.k_cache, kv.v_cache, meta, self.scale, kv.k_scale, kv.v_scale).flatten(-2)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: Sequence[LayerKV],
                meta: AttentionMetadata, capture_layers: Sequence[int] = ()
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run every layer over the flattened batch; returns final hidden states and, if asked,
        the outputs of ``capture_layers`` concatenated on the feature axis (the drafter's context)."""
        def attention(i: int, layer: DecoderLayerWeights, qkv: torch.Tensor) -> torch.Tensor:
            return self.attention(layer, qkv, positions, kv[i], meta)

        wanted = set(capture_layers)
        h, captured = decoder_layers(self.embed(input_ids), self.layers, attention, self.config.rms_norm_eps,
                                     meta.backend, self.reduce if self.tp is not None else None, wanted)
        if not capture_layers:
            return h, None
        # Hugging Face's hidden_states[L] (the last layer's output) is taken after the final norm; drafters are
        # trained on that indexing, so capture it the same way.
        last = len(self.layers) - 1
        if last in wanted:
            captured[last] = rms_norm(h, self.norm, self.config.rms_norm_eps)
        return h, torch.cat([captured[i] for i in capture_layers], dim=-1)
