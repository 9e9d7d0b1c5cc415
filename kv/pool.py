"""KV pools: one contiguous buffer per group of layers with equal page byte size, sliced into per-layer views.

A group buffer is page-major, ``[num_pages, layers_in_group, 2 (K, V), kv_heads * page_size * head_dim]``
in bytes, so one page of a group is one contiguous region: a transfer moves a page with one
descriptor per group. Inside a page, target layers come before draft layers, so "target layers only"
is a contiguous prefix of every page too. Layers of different dtypes may share a group when their
page byte sizes match; each layer's view keeps its own dtype.

Inside a layer's K (and V) of a page the layout is head-major, ``[kv_heads, page_size, head_dim]``
(``PAGE_LAYOUT``): the page's tokens of one kv head are one contiguous run, so a peer of another TP size
READs a slice of heads as one fragment per page, layer and K/V. The views keep the logical index order
``[num_pages, page_size, kv_heads, head_dim]`` with the strides of that layout.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kv.spec import KVLayerSpec, LayerOwner

# The order of a layer's K (or V) bytes inside a page: kv head, then token, then head dim.
PAGE_LAYOUT = "head_major"

# A function that returns a zeroed uint8 tensor of n bytes; actors pass one backed by shared memory.
BufferAllocator = Callable[[int], torch.Tensor]


@dataclass(frozen=True)
class LayerLocation:
    """Where a layer's pages live: its group, its byte offset inside a page of that group, and strides."""

    group: int
    slot: int                  # index of the layer inside the group
    offset_in_page: int        # bytes from the start of a group page to this layer's K
    page_stride: int           # bytes between consecutive pages of the group
    kv_bytes: int              # bytes of K (equal to V) of one page of this layer


@dataclass
class PoolGroup:
    page_bytes_per_layer: int      # K + V bytes of one page of one layer
    layers: list[KVLayerSpec]
    buffer: torch.Tensor           # uint8 [num_pages, len(layers), 2, kv_bytes]

    @property
    def page_stride(self) -> int:
        return len(self.layers) * self.page_bytes_per_layer

    def num_layers_of(self, owner: LayerOwner) -> int:
        return sum(1 for spec in self.layers if spec.owner == owner)


class KVPool:
    """The memory of one page space: every layer's K/V pages, indexed by a shared page id."""

    def __init__(self, specs: Sequence[KVLayerSpec], page_size: int, num_pages: int,
                 device: torch.device | str = "cpu", allocate: BufferAllocator | None = None):
        if page_size <= 0 or num_pages <= 0:
            raise ValueError(f"page_size and num_pages must be positive, got {page_size} and {num_pages}")
        if not specs:
            raise ValueError("a KV pool needs at least one layer")
        names = [spec.name for spec in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate layers in a KV pool: {names}")
        self.page_size = page_size
        self.num_pages = num_pages
        self.device = torch.device(device)
        self.specs = list(specs)
        allocate = allocate or (lambda n: torch.zeros(n, dtype=torch.uint8, device=self.device))

        # Group by page byte size; target layers first inside a group (see the module docstring).
        by_size: dict[int, list[KVLayerSpec]] = {}
        order = {LayerOwner.TARGET: 0, LayerOwner.DRAFT: 1}
        for spec in sorted(self.specs, key=lambda s: (order[s.owner], s.layer_index)):
            by_size.setdefault(spec.page_bytes(page_size), []).append(spec)
        self.groups: list[PoolGroup] = []
        self._locations: dict[str, LayerLocation] = {}
        self._views: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for group_index, (page_bytes, layers) in enumerate(by_size.items()):
            kv_bytes = page_bytes // 2
            raw = allocate(num_pages * len(layers) * page_bytes)
            if raw.dtype != torch.uint8 or raw.numel() != num_pages * len(layers) * page_bytes:
                raise ValueError("the buffer allocator must return a uint8 tensor of the requested size")
            buffer = raw.view(num_pages, len(layers), 2, kv_bytes)
            group = PoolGroup(page_bytes, layers, buffer)
            self.groups.append(group)
            for slot, spec in enumerate(layers):
                self._locations[spec.name] = LayerLocation(group_index, slot, slot * page_bytes,
                                                           group.page_stride, kv_bytes)
                shape = (spec.num_kv_heads, page_size, spec.head_dim)
                k, v = (buffer[:, slot, i].view(spec.dtype).unflatten(-1, shape).transpose(1, 2) for i in (0, 1))
                self._views[spec.name] = (k, v)

    def kv_views(self, owner: LayerOwner, layer_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V views ``[num_pages, page_size, kv_heads, head_dim]`` of one layer, in its own dtype, with the
        strides of the head-major page (``[page, head, token, dim]`` in memory)."""
        return self._views[f"{owner.value}.{layer_index}"]

    def spec(self, owner: LayerOwner, layer_index: int) -> KVLayerSpec:
        name = f"{owner.value}.{layer_index}"
        return next(s for s in self.specs if s.name == name)

    def location(self, owner: LayerOwner, layer_index: int) -> LayerLocation:
        return self._locations[f"{owner.value}.{layer_index}"]

    def has_owner(self, owner: LayerOwner) -> bool:
        return any(spec.owner == owner for spec in self.specs)

    def num_layers(self, owner: LayerOwner) -> int:
        return sum(1 for spec in self.specs if spec.owner == owner)

    @property
    def bytes_per_page(self) -> int:
        return sum(group.page_stride for group in self.groups)

    @property
    def nbytes(self) -> int:
        return self.bytes_per_page * self.num_pages

    def page_regions(self, page_ids: Sequence[int], owners: Sequence[LayerOwner] = (LayerOwner.TARGET, LayerOwner.DRAFT)
                     ) -> list[tuple[int, int, int]]:
        """``(group, byte offset in the group buffer, length)`` for each page: what a transfer moves.

        With both owners a page of a group is one region; with target only it is the target prefix.
        """
        return [(group_index, page * self.groups[group_index].page_stride + start, length)
                for group_index, start, length in self.page_spans(owners) for page in page_ids]

    def page_spans(self, owners: Sequence[LayerOwner] = (LayerOwner.TARGET, LayerOwner.DRAFT)
                   ) -> list[tuple[int, int, int]]:
        """``(group, byte offset inside a page, length)`` of the chosen layers' run in each group's pages (groups
        without one are left out)."""
        spans = []
        for group_index, group in enumerate(self.groups):
            n_target = group.num_layers_of(LayerOwner.TARGET)
            first = 0 if LayerOwner.TARGET in owners else n_target
            last = len(group.layers) if LayerOwner.DRAFT in owners else n_target
            if last > first:
                spans.append((group_index, first * group.page_bytes_per_layer,
                              (last - first) * group.page_bytes_per_layer))
        return spans

    def copy_pages(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy whole pages (every layer) ``src -> dst``; used when a forked request writes a shared page."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], device=self.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.device)
        for group in self.groups:
            group.buffer[dst] = group.buffer[src]
