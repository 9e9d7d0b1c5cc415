"""Layer specs of the unified paged KV cache: what each layer stores and how many bytes a page takes."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8": "float8_e4m3fn",
                 "fp8_e4m3": "float8_e4m3fn", "half": "float16", "float": "float32"}


def parse_dtype(name: str | torch.dtype, what: str = "KV cache dtype") -> torch.dtype:
    """Map a user-facing dtype name (``bf16``, ``fp8``, ``float32`` ...) to a torch dtype; ``what`` names the
    setting in the error."""
    if isinstance(name, torch.dtype):
        if name not in DTYPES.values():
            raise ValueError(f"unsupported {what} {name}; choose one of {sorted(DTYPES)}")
        return name
    key = DTYPE_ALIASES.get(name, name)
    if key not in DTYPES:
        raise ValueError(f"unknown {what} {name!r}; choose one of {sorted(DTYPES) + sorted(DTYPE_ALIASES)}")
    return DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class LayerOwner(str, enum.Enum):
    TARGET = "target"
    DRAFT = "draft"


@dataclass(frozen=True)
class KVLayerSpec:
    """One attention layer's KV storage: who owns it, its dtype and head geometry.

    ``layer_index`` is the layer's index inside its owner's model (target layer 3, draft layer 0).
    ``scale`` is the per-layer dequantisation scale of an FP8 layer (1.0 otherwise).
    """

    owner: LayerOwner
    layer_index: int
    dtype: torch.dtype
    num_kv_heads: int
    head_dim: int
    scale: float = 1.0

    def __post_init__(self):
        # Accept a dtype name ("bf16", "fp8") and store the torch dtype: element_size and the views need it.
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))
        if self.num_kv_heads <= 0 or self.head_dim <= 0:
            raise ValueError(f"layer {self.name}: kv heads and head dim must be positive")
        if self.scale <= 0:
            raise ValueError(f"layer {self.name}: scale must be positive, got {self.scale}")

    @property
    def name(self) -> str:
        return f"{self.owner.value}.{self.layer_index}"

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def bytes_per_token(self) -> int:
        """K and V bytes one token takes in this layer."""
        return 2 * self.num_kv_heads * self.head_dim * self.element_size

    def page_bytes(self, page_size: int) -> int:
        return page_size * self.bytes_per_token()


def make_layer_specs(owner: LayerOwner, num_layers: int, dtype: torch.dtype, num_kv_heads: int,
                     head_dim: int, scale: float = 1.0) -> list[KVLayerSpec]:
    return [KVLayerSpec(owner, i, dtype, num_kv_heads, head_dim, scale) for i in range(num_layers)]
