"""Hugging Face checkpoint reading: config.json, safetensors (single file or sharded index), tokenizer."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open


class CheckpointError(ValueError):
    """A model directory that cannot be served: missing, malformed, or missing tensors."""


def read_config(model_dir: str | Path) -> dict:
    path = Path(model_dir)
    if not path.is_dir():
        raise CheckpointError(f"model directory {str(path)!r} does not exist")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{path}: no config.json")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config_path}: malformed JSON ({e})") from e
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_path}: expected a JSON object")
    return config


def require(config: dict, key: str, kind: type, source: str):
    if key not in config:
        raise CheckpointError(f"{source}: missing field {key!r}")
    value = config[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise CheckpointError(f"{source}: field {key!r} must be {kind.__name__}, got {value!r}")
    if kind in (int, float) and value <= 0:
        raise CheckpointError(f"{source}: field {key!r} must be positive, got {value!r}")
    return value


@dataclass(frozen=True)
class Qwen3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    torch_dtype: str

    @classmethod
    def from_dict(cls, config: dict, source: str = "config.json") -> "Qwen3Config":
        hidden = require(config, "hidden_size", int, source)
        heads = require(config, "num_attention_heads", int, source)
        kv_heads = config.get("num_key_value_heads", heads)
        if not isinstance(kv_heads, int) or kv_heads <= 0 or heads % kv_heads:
            raise CheckpointError(f"{source}: num_key_value_heads {kv_heads!r} must divide num_attention_heads {heads}")
        head_dim = config.get("head_dim") or hidden // heads
        rope_theta = config.get("rope_theta")
        if rope_theta is None:   # newer transformers nest it under rope_parameters
            rope_theta = (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        eos = config.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            vocab_size=require(config, "vocab_size", int, source),
            hidden_size=hidden,
            intermediate_size=require(config, "intermediate_size", int, source),
            num_hidden_layers=require(config, "num_hidden_layers", int, source),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
            torch_dtype=str(config.get("torch_dtype") or config.get("dtype") or "float32"),
        )


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: malformed index ({e})") from e
        files = sorted({model_dir / name for name in weight_map.values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no safetensors weights")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{model_dir}: weight files named in the index are missing: {missing}")
    return files


def load_tensors(model_dir: str | Path, dtype: torch.dtype, device: torch.device | str = "cpu",
                 strip_prefix: str = "", shard=None) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, cast to ``dtype`` on ``device``, with ``strip_prefix`` removed from names.

    ``shard(name)`` (an ``engine.parallel.ShardPlan.shard``) names the slice a tensor-parallel rank reads; only
    that slice is read from the file.
    """
    tensors = {}
    for file in safetensors_files(Path(model_dir)):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                key = name.removeprefix(strip_prefix)
                part = shard(key) if shard is not None else None
                if part is None:
                    tensor = f.get_tensor(name)
                else:
                    index = [slice(None)] * len(f.get_slice(name).get_shape())
                    index[part.dim] = slice(part.start, part.end)
                    tensor = f.get_slice(name)[tuple(index)]
                    if part.end - part.start < part.size:      # the last vocab shard: zero rows up to equal size
                        pad = list(tensor.shape)
                        pad[part.dim] = part.size - (part.end - part.start)
                        tensor = torch.cat([tensor, tensor.new_zeros(pad)], dim=part.dim)
                tensors[key] = tensor.to(device=device, dtype=dtype)
    return tensors


def take(tensors: dict[str, torch.Tensor], name: str, shape: tuple[int, ...], source: str) -> torch.Tensor:
    if name not in tensors:
        raise CheckpointError(f"{source}: missing tensor {name!r}")
    tensor = tensors[name]
    if tuple(tensor.shape) != shape:
        raise CheckpointError(f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape}")
    return tensor
