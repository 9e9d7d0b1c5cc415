"""The DFlash drafter: a stack of Qwen3 decoder layers that drafts a whole block in one forward pass.

It has no embedding and no LM head of its own (it uses the target's). Its context is the target's
hidden states at ``target_layer_ids``, projected by ``fc`` + ``hidden_norm``; each draft layer turns
that context into K/V (k_norm, then RoPE at absolute positions) and the block ``[anchor, MASK...]``
attends to that context and, non-causally, to itself.

One definition serves both uses: serving (``store_context`` / ``forward_block``: the context K/V live in
draft-layer KV pages, attention is paged) and training (``forward``: dense attention over the projected
context with an anchor mask). The weights are ``nn.Parameter``s; ``from_pretrained`` and
``save_pretrained`` read and write the z-lab checkpoint layout.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from engine.attention import AttentionMetadata, paged_attention
from engine.checkpoint import CheckpointError, Qwen3Config, load_tensors, read_config, require, take
from engine.model import (DecoderLayerWeights, LayerAttention, LayerKV, Qwen3Model, add_rms_norm, attention_heads,
                          decoder_layers, linear, load_decoder_layer, rope_table)
from engine.parallel import ShardPlan, TensorParallel, active
from kv.spec import KVLayerSpec, LayerOwner, make_layer_specs


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Evenly spaced from 1 to L-3 (a single draft layer reads the middle layer, L // 2)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    num_target_layers: int | None = None
    max_position_embeddings: int = 2048

    @classmethod
    def from_dict(cls, raw: dict, source: str, num_target_layers: int | None = None) -> "DFlashConfig":
        """A z-lab ``config.json``; ``num_target_layers`` (the target's) places default target_layer_ids."""
        archs = raw.get("architectures") or []
        if "DFlashDraftModel" not in archs:
            raise CheckpointError(f"{source}: architectures must include 'DFlashDraftModel', got {archs!r}")
        dflash = raw.get("dflash_config") or {}
        if not isinstance(dflash, dict):
            raise CheckpointError(f"{source}: dflash_config must be an object")
        block_size = raw.get("block_size", dflash.get("block_size"))
        if not isinstance(block_size, int) or block_size < 2:
            raise CheckpointError(f"{source}: block_size must be an integer >= 2, got {block_size!r}")
        if "mask_token_id" not in dflash:
            raise CheckpointError(f"{source}: dflash_config.mask_token_id is missing")
        hidden = require(raw, "hidden_size", int, source)
        heads = require(raw, "num_attention_heads", int, source)
        layers = require(raw, "num_hidden_layers", int, source)
        ids = dflash.get("target_layer_ids")
        if ids is None:
            num_target_layers = raw.get("num_target_layers") or num_target_layers
            if num_target_layers is None:
                raise CheckpointError(f"{source}: without dflash_config.target_layer_ids, num_target_layers is needed")
            ids = default_target_layer_ids(num_target_layers, layers)
        rope_theta = raw.get("rope_theta") or (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return cls(
            hidden_size=hidden,
            intermediate_size=require(raw, "intermediate_size", int, source),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads", heads)),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            vocab_size=require(raw, "vocab_size", int, source),
            block_size=block_size,
            mask_token_id=int(dflash["mask_token_id"]),
            target_layer_ids=tuple(int(i) for i in ids),
            num_target_layers=raw.get("num_target_layers"),
            max_position_embeddings=int(raw.get("max_position_embeddings") or 2048),
        )

    def to_dict(self, dtype: torch.dtype = torch.bfloat16) -> dict:
        """The z-lab ``config.json`` of a checkpoint saved in ``dtype``."""
        return {
            "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
            "hidden_size": self.hidden_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "intermediate_size": self.intermediate_size, "vocab_size": self.vocab_size,
            "block_size": self.block_size, "num_target_layers": self.num_target_layers,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)},
            "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
            "dtype": str(dtype).removeprefix("torch."),
        }

    def shard_plan(self, tp: TensorParallel | None) -> ShardPlan:
        """The drafter's share on ``tp``'s rank, split like the target's (it has no vocab of its own)."""
        size, rank = (tp.size, tp.rank) if tp is not None else (1, 0)
        return ShardPlan(size, rank, heads=self.num_attention_heads, kv_heads=self.num_key_value_heads,
                         head_dim=self.head_dim, intermediate=self.intermediate_size, who="the DFlash drafter")

    def check_target(self, t: Qwen3Config, source: str) -> None:
        """Refuse a target this drafter was not made for."""
        if self.hidden_size != t.hidden_size:
            raise CheckpointError(f"{source}: drafter hidden_size {self.hidden_size} != target hidden_size "
                                  f"{t.hidden_size}")
        if self.vocab_size != t.vocab_size:
            raise CheckpointError(f"{source}: drafter vocab_size {self.vocab_size} != target vocab_size {t.vocab_size}")
        if not 0 <= self.mask_token_id < t.vocab_size:
            raise CheckpointError(f"{source}: mask_token_id {self.mask_token_id} is outside the target vocabulary "
                                  f"[0, {t.vocab_size})")
        if self.num_target_layers is not None and self.num_target_layers != t.num_hidden_layers:
            raise CheckpointError(f"{source}: drafter was built for {self.num_target_layers} target layers, "
                                  f"the target has {t.num_hidden_layers}")
        bad = [i for i in self.target_layer_ids if not 0 <= i < t.num_hidden_layers]
        if bad or not self.target_layer_ids:
            raise CheckpointError(f"{source}: target_layer_ids {list(self.target_layer_ids)} must be non-empty and "
                                  f"within the target's {t.num_hidden_layers} layers")


class DFlashLayer(nn.Module):
    """One draft decoder layer. Its parameters are named as the engine's ``DecoderLayerWeights`` (q/k/v and
    gate/up fused), so ``engine.model.decoder_layers`` runs it; ``DFlashDrafter.checkpoint_tensors`` gives the
    z-lab names."""

    def __init__(self, weights: DecoderLayerWeights):
        super().__init__()
        for f in dataclasses.fields(DecoderLayerWeights):
            setattr(self, f.name, nn.Parameter(getattr(weights, f.name)))


class DFlashDrafter(nn.Module):
    """Qwen3 decoder layers drafting a block from projected target features (serving and training)."""

    def __init__(self, config: DFlashConfig, tensors: dict[str, torch.Tensor], source: str = "tensors",
                 max_positions: int | None = None, tp: TensorParallel | None = None):
        """The drafter over checkpoint-named ``tensors`` (taken as they are: their device and dtype are the
        drafter's; under ``tp`` this rank's shards); RoPE covers ``max_positions`` (default
        ``config.max_position_embeddings``)."""
        super().__init__()
        c = config
        self.config = c
        self.tp = active(tp)
        plan = c.shard_plan(self.tp)
        self.num_heads, self.num_kv_heads = plan.num_heads, plan.num_kv_heads
        self.layers = nn.ModuleList(
            DFlashLayer(load_decoder_layer(tensors, f"layers.{i}.", c.hidden_size, plan.num_heads,
                                           plan.num_kv_heads, c.head_dim, plan.intermediate_size, source))
            for i in range(c.num_hidden_layers))
        n = len(c.target_layer_ids)
        self.fc = nn.Parameter(take(tensors, "fc.weight", (c.hidden_size, n * c.hidden_size), source))
        self.hidden_norm = nn.Parameter(take(tensors, "hidden_norm.weight", (c.hidden_size,), source))
        self.norm = nn.Parameter(take(tensors, "norm.weight", (c.hidden_size,), source))
        cos, sin = rope_table(c.head_dim, c.rope_theta, max_positions or c.max_position_embeddings, self.fc.device)
        self.register_buffer("rope_cos", cos.to(self.fc.dtype), persistent=False)
        self.register_buffer("rope_sin", sin.to(self.fc.dtype), persistent=False)
        self.scale = c.head_dim ** -0.5

    @classmethod
    def initialized(cls, config: DFlashConfig, std: float = 0.02, device: torch.device | str = "cpu",
                    generator: torch.Generator | None = None) -> "DFlashDrafter":
        """A float32 drafter to train: matrices ~ N(0, std^2), norm gains 1."""
        tensors = {name: (torch.ones(shape, device=device) if len(shape) == 1 else
                          torch.randn(shape, generator=generator, device=device) * std)
                   for name, shape in checkpoint_shapes(config).items()}
        return cls(config, tensors, "initialized")

    @classmethod
    def from_pretrained(cls, draft_dir: str | Path, target: Qwen3Model | None = None, device="cpu",
                        dtype: torch.dtype = torch.float32) -> "DFlashDrafter":
        """Load a z-lab checkpoint; with ``target``, check that the drafter fits it and size RoPE to it; a
        tensor-parallel target gets a drafter sharded the same way (only this rank's slices are read)."""
        raw = read_config(draft_dir)
        source = f"{draft_dir}/config.json"
        config = DFlashConfig.from_dict(raw, source, target.config.num_hidden_layers if target else None)
        if target is not None:
            config.check_target(target.config, str(draft_dir))
        tp = target.tp if target is not None else None
        plan = config.shard_plan(tp)
        tensors = load_tensors(draft_dir, dtype, device, shard=plan.shard if tp else None)
        return cls(config, tensors, str(draft_dir), target.rope.max_positions if target else None, tp)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The weights under their z-lab checkpoint names (views of the parameters, detached)."""
        c = self.config
        q_dim, kv_dim = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        out = {}
        for i, layer in enumerate(self.layers):
            p = f"layers.{i}."
            q, k, v = layer.qkv.split([q_dim, kv_dim, kv_dim])
            gate, up = layer.gate_up.chunk(2)
            out.update({
                p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": layer.o,
                p + "self_attn.q_norm.weight": layer.q_norm, p + "self_attn.k_norm.weight": layer.k_norm,
                p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up, p + "mlp.down_proj.weight": layer.down,
                p + "input_layernorm.weight": layer.input_norm,
                p + "post_attention_layernorm.weight": layer.post_norm,
            })
        out.update({"fc.weight": self.fc, "hidden_norm.weight": self.hidden_norm, "norm.weight": self.norm})
        return {name: t.detach() for name, t in out.items()}

    def save_pretrained(self, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
        """``model.safetensors`` and ``config.json`` in the z-lab layout, weights cast to ``dtype``."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        tensors = {name: t.to(dtype).contiguous().cpu() for name, t in self.checkpoint_tensors().items()}
        save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        (out_dir / "config.json").write_text(json.dumps(self.config.to_dict(dtype), indent=2) + "\n")

    @property
    def device(self) -> torch.device:
        return self.fc.device

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return self.config.target_layer_ids

    def kv_layer_specs(self, dtype: torch.dtype) -> list[KVLayerSpec]:
        """This rank's draft layers: its share of the kv heads, as the target's layers in the same pool."""
        c = self.config
        return make_layer_specs(LayerOwner.DRAFT, c.num_hidden_layers, dtype, self.num_kv_heads, c.head_dim)

    # --- the layers -----------------------------------------------------------------------------
    def project_context(self, captured: torch.Tensor, backend: str = "torch") -> torch.Tensor:
        """Target hidden states [..., n*H] at target_layer_ids -> drafter context [..., H]."""
        return add_rms_norm(linear(captured, self.fc, backend), self.hidden_norm, self.config.rms_norm_eps,
                            backend=backend)[0]

    def _heads(self, layer: DFlashLayer, num_heads: int, qkv: torch.Tensor, positions: torch.Tensor, backend: str,
               kv: LayerKV | None = None, slot_mapping: torch.Tensor | None = None):
        """``engine.model.attention_heads`` of this layer: q (``num_heads`` of them: all or none), k and v, or with
        ``kv`` q alone, k and v written into the layer's pages."""
        c = self.config
        return attention_heads(qkv, num_heads, self.num_kv_heads, c.head_dim, layer.q_norm, layer.k_norm,
                               c.rms_norm_eps, positions, self.rope_cos, self.rope_sin, backend, kv, slot_mapping)

    def _kv_projection(self, layer: DFlashLayer, x: torch.Tensor, backend: str = "torch") -> torch.Tensor:
        """The k and v part of the qkv projection of context rows ``x`` (their q is never needed)."""
        return linear(x, layer.qkv[self.num_heads * self.config.head_dim:], backend)

    def _decode(self, h: torch.Tensor, attention: LayerAttention, backend: str = "torch") -> torch.Tensor:
        """The draft layers over the block's hidden states; ``attention`` is each layer's over the context and the
        block (paged when serving, dense when training)."""
        return decoder_layers(h, self.layers, attention, self.config.rms_norm_eps, backend,
                              self._reduce if self.tp is not None else None)[0]

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        # Row-parallel o_proj and down_proj: each rank holds a partial sum (nothing to do without TP).
        return x if self.tp is None else self.tp.all_reduce(x)

    def final_norm(self, hidden: torch.Tensor, backend: str = "torch") -> torch.Tensor:
        return add_rms_norm(hidden, self.norm, self.config.rms_norm_eps, backend=backend)[0]

    def compute_logits(self, hidden: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
        """float32 logits through the final norm and the target's (whole) LM head weight ``[V, H]``."""
        return F.linear(self.final_norm(hidden), lm_head).float()

    # --- serving: context K/V in draft-layer pages ---------------------------------------------
    def store_context(self, context: torch.Tensor, positions: torch.Tensor, layer_kv: Sequence[LayerKV],
                      slot_mapping: torch.Tensor, backend: str) -> None:
        """Write every draft layer's K/V of the context tokens (no input_layernorm on the context)."""
        for layer, kv in zip(self.layers, layer_kv):
            self._heads(layer, 0, self._kv_projection(layer, context, backend), positions, backend, kv, slot_mapping)

    def forward_block(self, block_embeds: torch.Tensor, positions: torch.Tensor, layer_kv: Sequence[LayerKV],
                      meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states of the embedded blocks ``[anchor, MASK...]`` (flattened, ``[N, H]``): the block's K/V
        go into the pages right after each context, and attention is non-causal over context and block."""
        def attention(i: int, layer: DFlashLayer, qkv: torch.Tensor) -> torch.Tensor:
            kv = layer_kv[i]
            q, _, _ = self._heads(layer, self.num_heads, qkv, positions, meta.backend, kv, meta.slot_mapping)
            return paged_attention(q, kv.k_cache, kv.v_cache, meta, self.scale, kv.k_scale,
                                   kv.v_scale).flatten(-2)
        return self._decode(block_embeds, attention, meta.backend)

    # --- training: dense attention over the projected context ----------------------------------
    def forward(self, block_embeds: torch.Tensor, block_positions: torch.Tensor, target_features: torch.Tensor,
                context_positions: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states ``[S, L, H]`` (before the final norm: ``compute_logits`` applies it) of the embedded
        blocks ``[S, L, H]`` at ``block_positions`` ``[S, L]``, over the target features ``[S, T, n*H]`` at
        ``context_positions`` (``[S or 1, T]``). ``attn_mask`` (bool, True = attend, ``[S, 1, L, T + L]``) is
        over the [context, block] keys; None lets every block query see everything."""
        c = self.config
        context = self.project_context(target_features)
        group = c.num_attention_heads // c.num_key_value_heads

        def attention(i: int, layer: DFlashLayer, qkv: torch.Tensor) -> torch.Tensor:
            q, k, v = self._heads(layer, self.num_heads, qkv, block_positions, "torch")
            # The context K/V are exactly what serving stores in the draft layer's pages.
            _, k_ctx, v_ctx = self._heads(layer, 0, self._kv_projection(layer, context), context_positions, "torch")
            k = torch.cat([k_ctx, k], dim=-3).repeat_interleave(group, dim=-2)
            v = torch.cat([v_ctx, v], dim=-3).repeat_interleave(group, dim=-2)
            out = F.scaled_dot_product_attention(q.transpose(-3, -2), k.transpose(-3, -2), v.transpose(-3, -2),
                                                 attn_mask=attn_mask, scale=self.scale)
            return out.transpose(-3, -2).flatten(-2)
        return self._decode(block_embeds, attention)


def checkpoint_shapes(config: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a z-lab DFlash checkpoint and its shape."""
    c = config
    h, hd, inter = c.hidden_size, c.head_dim, c.intermediate_size
    q_dim, kv_dim = c.num_attention_heads * hd, c.num_key_value_heads * hd
    shapes = {}
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (q_dim, h), p + "self_attn.k_proj.weight": (kv_dim, h),
            p + "self_attn.v_proj.weight": (kv_dim, h), p + "self_attn.o_proj.weight": (h, q_dim),
            p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        })
    shapes.update({"fc.weight": (h, len(c.target_layer_ids) * h), "hidden_norm.weight": (h,), "norm.weight": (h,)})
    return shapes
