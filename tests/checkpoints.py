"""Writers of tiny random checkpoints for tests (transformers for the target, safetensors for drafters)."""

from __future__ import annotations

from pathlib import Path

import torch

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0)


def write_tiny_qwen3(path: Path, seed: int = 0, **overrides) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(**{**TINY, "tie_word_embeddings": False, **overrides})
    model = Qwen3ForCausalLM(config).to(torch.float32)
    # Random init is near-degenerate (tiny weights): widen it so logits differ across tokens.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return Path(path)


def write_tiny_drafter(path: Path, num_layers: int = 1, block_size: int = 4, target_layer_ids=(0, 1),
                       mask_token_id: int = 127, seed: int = 0, scale: float = 0.2, **overrides) -> Path:
    """A random DFlash drafter in the z-lab layout, shaped for the tiny target."""
    import json

    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    c = {**TINY, "num_hidden_layers": num_layers, **overrides}
    h, hd, nq, nkv, inter = c["hidden_size"], c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"], \
        c["intermediate_size"]

    def rand(*shape):
        return torch.randn(*shape, generator=g) * scale

    def norm(n):
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    tensors = {"fc.weight": rand(h, len(target_layer_ids) * h), "hidden_norm.weight": norm(h), "norm.weight": norm(h)}
    for i in range(num_layers):
        p = f"layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": rand(nq * hd, h), p + "self_attn.k_proj.weight": rand(nkv * hd, h),
            p + "self_attn.v_proj.weight": rand(nkv * hd, h), p + "self_attn.o_proj.weight": rand(h, nq * hd),
            p + "self_attn.q_norm.weight": norm(hd), p + "self_attn.k_norm.weight": norm(hd),
            p + "mlp.gate_proj.weight": rand(inter, h), p + "mlp.up_proj.weight": rand(inter, h),
            p + "mlp.down_proj.weight": rand(h, inter),
            p + "input_layernorm.weight": norm(h), p + "post_attention_layernorm.weight": norm(h),
        })
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    config = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": block_size,
              "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": list(target_layer_ids)},
              "num_target_layers": None, **{k: v for k, v in c.items()}}
    config.pop("num_target_layers")
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path
