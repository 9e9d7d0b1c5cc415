"""The DFlash drafter: a stack of Qwen3 decoder layers that drafts a whole block in one forward pass.

It has no embedding and no LM head of its own (it uses the target's). Its context is the target's
hidden states at ``target_layer_ids``, projected by ``fc`` + ``hidden_norm``; each draft layer turns
that context into K/V (k_norm, then RoPE at absolute positions) stored in its own draft-layer pages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.attention import AttentionMetadata, paged_attention, store_kv
from engine.checkpoint import CheckpointError, load_tensors, read_config, require, take
from engine.model import LayerKV, Qwen3Model, RotaryEmbedding, load_decoder_layer, rms_norm, swiglu_mlp
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
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int | None

    @classmethod
    def from_dict(cls, raw: dict, source: str, num_target_layers: int) -> "DFlashConfig":
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
            ids = default_target_layer_ids(raw.get("num_target_layers") or num_target_layers, layers)
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
        )


class DFlashDrafter:
    def __init__(self, config: DFlashConfig, tensors: dict[str, torch.Tensor], target: Qwen3Model, source: str):
        c, t = config, target.config
        if c.hidden_size != t.hidden_size:
            raise CheckpointError(f"{source}: drafter hidden_size {c.hidden_size} != target hidden_size {t.hidden_size}")
        if c.vocab_size != t.vocab_size:
            raise CheckpointError(f"{source}: drafter vocab_size {c.vocab_size} != target vocab_size {t.vocab_size}")
        if not 0 <= c.mask_token_id < t.vocab_size:
            raise CheckpointError(f"{source}: mask_token_id {c.mask_token_id} is outside the target vocabulary "
                                  f"[0, {t.vocab_size})")
        if c.num_target_layers is not None and c.num_target_layers != t.num_hidden_layers:
            raise CheckpointError(f"{source}: drafter was built for {c.num_target_layers} target layers, "
                                  f"the target has {t.num_hidden_layers}")
        bad = [i for i in c.target_layer_ids if not 0 <= i < t.num_hidden_layers]
        if bad or not c.target_layer_ids:
            raise CheckpointError(f"{source}: target_layer_ids {list(c.target_layer_ids)} must be non-empty and "
                                  f"within the target's {t.num_hidden_layers} layers")
        self.config = c
        self.target = target
        self.device = target.device
        self.dtype = target.dtype
        self.layers = [
            load_decoder_layer(tensors, f"layers.{i}.", c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
                               c.head_dim, c.intermediate_size, source)
            for i in range(c.num_hidden_layers)
        ]
        n = len(c.target_layer_ids)
        self.fc = take(tensors, "fc.weight", (c.hidden_size, n * c.hidden_size), source)
        self.hidden_norm = take(tensors, "hidden_norm.weight", (c.hidden_size,), source)
        self.norm = take(tensors, "norm.weight", (c.hidden_size,), source)
        self.rope = RotaryEmbedding(c.head_dim, c.rope_theta, target.rope.max_positions, self.device, self.dtype)
        self.scale = c.head_dim ** -0.5

    @classmethod
    def from_pretrained(cls, draft_dir: str | Path, target: Qwen3Model, device="cpu",
                        dtype: torch.dtype = torch.float32) -> "DFlashDrafter":
        raw = read_config(draft_dir)
        source = f"{draft_dir}/config.json"
        config = DFlashConfig.from_dict(raw, source, target.config.num_hidden_layers)
        tensors = load_tensors(draft_dir, dtype, device)
        return cls(config, tensors, target, str(draft_dir))

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return self.config.target_layer_ids

    def kv_layer_specs(self, dtype: torch.dtype) -> list[KVLayerSpec]:
        c = self.config
        return make_layer_specs(LayerOwner.DRAFT, c.num_hidden_layers, dtype, c.num_key_value_heads, c.head_dim)

    # --- context ------------------------------------------------------------------------------
    def project_context(self, captured: torch.Tensor) -> torch.Tensor:
        """Target hidden states [N, n*H] at target_layer_ids -> drafter context [N, H]."""
        return rms_norm(F.linear(captured, self.fc), self.hidden_norm, self.config.rms_norm_eps)

    def _kv(self, layer, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        q_dim, kv_dim = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        k, v = F.linear(x, layer.qkv[q_dim:]).split([kv_dim, kv_dim], dim=-1)
        k = rms_norm(k.unflatten(-1, (c.num_key_value_heads, c.head_dim)), layer.k_norm, c.rms_norm_eps)
        return self.rope(k, positions), v.unflatten(-1, (c.num_key_value_heads, c.head_dim))

    def store_context(self, context: torch.Tensor, positions: torch.Tensor, layer_kv: Sequence[LayerKV],
                      slot_mapping: torch.Tensor, backend: str) -> None:
        """Write every draft layer's K/V of the context tokens (no input_layernorm on the context)."""
        for layer, kv in zip(self.layers, layer_kv):
            k, v = self._kv(layer, context, positions)
            store_kv(k, v, kv.k_cache, kv.v_cache, slot_mapping, kv.k_scale, kv.v_scale, backend=backend)

    # --- drafting -----------------------------------------------------------------------------
    def forward_block(self, block_ids: torch.Tensor, positions: torch.Tensor, layer_kv: Sequence[LayerKV],
                      meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states of the blocks ``[anchor, MASK...]`` (flattened): the block's K/V go into the pages
        right after each context, and attention is non-causal over context and block."""
        c = self.config
        q_dim = c.num_attention_heads * c.head_dim
        h = self.target.embed(block_ids)
        for layer, kv in zip(self.layers, layer_kv):
            x = rms_norm(h, layer.input_norm, c.rms_norm_eps)
            q = F.linear(x, layer.qkv[:q_dim]).unflatten(-1, (c.num_attention_heads, c.head_dim))
            q = self.rope(rms_norm(q, layer.q_norm, c.rms_norm_eps), positions)
            k, v = self._kv(layer, x, positions)
            store_kv(k, v, kv.k_cache, kv.v_cache, meta.slot_mapping, kv.k_scale, kv.v_scale, backend=meta.backend)
            out = paged_attention(q, kv.k_cache, kv.v_cache, meta, self.scale, kv.k_scale, kv.v_scale)
            h = h + F.linear(out.flatten(-2), layer.o)
            h = h + swiglu_mlp(rms_norm(h, layer.post_norm, c.rms_norm_eps), layer)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(rms_norm(hidden, self.norm, self.config.rms_norm_eps), self.target.lm_head).float()
