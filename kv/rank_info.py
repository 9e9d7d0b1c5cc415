"""What one rank publishes to its disaggregation peers, and the checks a peer must pass to register.

``RankInfo`` travels as versioned JSON: a payload from a peer is parsed, never unpickled; the NIXL agent
metadata (bytes) is base64. Version 1 payloads predate draft layers and read as 0 draft layers.
TP: a rank publishes its ``tp_size``, ``tp_rank`` and, per layer, the kv heads its pools hold (the first one and
how many) out of the layer's total. Peers of equal TP size exchange whole pages rank to rank; between different
TP sizes a rank READs, per layer, the kv-head slices it holds from the peer ranks holding them (``plan_reads``).
Version 2 payloads predate the head ranges and read as the even split ``[tp_rank * n, (tp_rank + 1) * n)``.
Version 4 adds ``page_layout``, the order of a layer's bytes inside a page (``kv.pool.PAGE_LAYOUT``); earlier
payloads read as ``token_major``, and a peer whose layout differs is refused: its pages hold other bytes.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from kv.pool import PAGE_LAYOUT, KVPool
from kv.spec import LayerOwner, dtype_name

RANK_INFO_VERSION = 4
PAGE_LAYOUTS = ("head_major", "token_major")


class PeerMismatchError(ValueError):
    """A peer's KV layout cannot exchange pages with this rank's; the message names both values."""


@dataclass(frozen=True)
class LayerInfo:
    owner: str              # "target" | "draft"
    layer_index: int
    dtype: str
    element_size: int
    num_kv_heads: int       # on this rank
    head_dim: int
    kv_head_start: int = 0  # the first of the layer's kv heads this rank holds
    total_kv_heads: int = 0  # the layer's kv heads over all ranks

    @property
    def name(self) -> str:
        return f"{self.owner}.{self.layer_index}"

    def holds(self, head: int) -> bool:
        return self.kv_head_start <= head < self.kv_head_start + self.num_kv_heads


@dataclass(frozen=True)
class GroupInfo:
    """One pool group of one page space as registered with NIXL: where its pages start and how they are laid out."""

    space: int
    group: int
    base_address: int       # address of page 0 in the publishing process
    device_id: int
    page_stride: int        # bytes of one page (every layer of the group)
    num_pages: int
    layers: tuple[str, ...]  # layer names in page order (target layers first)


@dataclass(frozen=True)
class RankInfo:
    tp_size: int
    tp_rank: int
    page_size: int
    num_target_layers: int
    num_draft_layers: int
    layers: tuple[LayerInfo, ...]
    groups: tuple[GroupInfo, ...] = ()
    memory_type: str = "DRAM"               # NIXL segment type: DRAM or VRAM
    agent_name: str = ""
    agent_metadata: bytes = b""
    page_layout: str = PAGE_LAYOUT          # "head_major" | "token_major" (payloads before version 4)
    version: int = RANK_INFO_VERSION

    def __post_init__(self):
        if self.page_layout not in PAGE_LAYOUTS:
            raise ValueError(f"page_layout must be one of {PAGE_LAYOUTS}, got {self.page_layout!r}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} is outside tp_size {self.tp_size}")
        counts = {owner: sum(1 for layer in self.layers if layer.owner == owner) for owner in ("target", "draft")}
        if (counts["target"], counts["draft"]) != (self.num_target_layers, self.num_draft_layers):
            raise ValueError(f"RankInfo lists {counts['target']} target and {counts['draft']} draft layers but says "
                             f"{self.num_target_layers} and {self.num_draft_layers}")

    @property
    def layer_map(self) -> dict[str, LayerInfo]:
        return {layer.name: layer for layer in self.layers}

    # --- serialization --------------------------------------------------------------------------
    def to_json(self) -> str:
        data = asdict(self)
        data["version"] = RANK_INFO_VERSION
        data["agent_metadata"] = base64.b64encode(self.agent_metadata).decode("ascii")
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, payload: str | bytes) -> "RankInfo":
        """Parse a peer's payload (any known version); unknown versions and malformed fields raise ValueError."""
        try:
            data = json.loads(payload)
        except (TypeError, ValueError) as e:      # JSONDecodeError, or bytes that are not UTF-8
            raise ValueError(f"RankInfo payload is not JSON: {e}") from None
        if not isinstance(data, dict):
            raise ValueError("RankInfo payload must be a JSON object")
        version = data.get("version", 1)
        if version not in (1, 2, 3, RANK_INFO_VERSION):
            raise ValueError(f"RankInfo version {version} is not supported (this build reads 1 to "
                             f"{RANK_INFO_VERSION})")
        try:
            layers = [dict(layer) for layer in data["layers"]]
            if version == 1:
                # Version 1 predates draft layers: every layer is a target layer.
                for layer in layers:
                    layer.setdefault("owner", "target")
            if version < 3:
                # Before head ranges: every rank held an even share of its layers' kv heads.
                for layer in layers:
                    layer.setdefault("kv_head_start", int(data["tp_rank"]) * int(layer["num_kv_heads"]))
                    layer.setdefault("total_kv_heads", int(data["tp_size"]) * int(layer["num_kv_heads"]))
            return cls(
                tp_size=int(data["tp_size"]), tp_rank=int(data["tp_rank"]), page_size=int(data["page_size"]),
                num_target_layers=int(data.get("num_target_layers", len(layers))),
                num_draft_layers=int(data.get("num_draft_layers", 0)),
                layers=tuple(LayerInfo(**layer) for layer in layers),
                groups=tuple(GroupInfo(**{**g, "layers": tuple(g["layers"])}) for g in data.get("groups", ())),
                memory_type=str(data.get("memory_type", "DRAM")),
                agent_name=str(data.get("agent_name", "")),
                agent_metadata=base64.b64decode(data.get("agent_metadata", ""), validate=True),
                page_layout=str(data["page_layout"]) if version >= 4 else "token_major",
                version=RANK_INFO_VERSION,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed RankInfo payload: {e}") from None


def kv_head_slice(total_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """(first kv head, kv heads) that rank ``tp_rank`` of ``tp_size`` holds of a layer's ``total_kv_heads``:
    an even share, or, with fewer heads than ranks, one head replicated on consecutive ranks (as vLLM does)."""
    if total_kv_heads % tp_size == 0:
        per_rank = total_kv_heads // tp_size
        return tp_rank * per_rank, per_rank
    if tp_size % total_kv_heads == 0:
        return tp_rank // (tp_size // total_kv_heads), 1
    raise ValueError(f"{total_kv_heads} kv heads neither split evenly over {tp_size} ranks nor replicate onto them")


def describe_pools(pools: Sequence[KVPool], *, tp_size: int = 1, tp_rank: int = 0,
                   base_addresses: Sequence[Sequence[int]] | None = None, device_id: int = 0,
                   memory_type: str = "DRAM", agent_name: str = "", agent_metadata: bytes = b"",
                   total_kv_heads: Mapping[str, int] | None = None) -> RankInfo:
    """The RankInfo of a rank's page spaces; ``base_addresses[space][group]`` are the registered addresses,
    ``total_kv_heads[layer name]`` each layer's kv heads over all ranks (default: an even split)."""
    layers, groups = [], []
    for space, pool in enumerate(pools):
        for spec in pool.specs:
            total = (total_kv_heads or {}).get(spec.name, spec.num_kv_heads * tp_size)
            start, count = kv_head_slice(total, tp_size, tp_rank)
            if count != spec.num_kv_heads:
                raise ValueError(f"layer {spec.name}: the pool holds {spec.num_kv_heads} kv heads, but rank {tp_rank} "
                                 f"of {tp_size} holds {count} of {total}")
            layers.append(LayerInfo(spec.owner.value, spec.layer_index, dtype_name(spec.dtype), spec.element_size,
                                    spec.num_kv_heads, spec.head_dim, start, total))
        for g, group in enumerate(pool.groups):
            base = base_addresses[space][g] if base_addresses is not None else group.buffer.data_ptr()
            groups.append(GroupInfo(space, g, int(base), device_id, group.page_stride, pool.num_pages,
                                    tuple(spec.name for spec in group.layers)))
    n_target = sum(1 for layer in layers if layer.owner == LayerOwner.TARGET.value)
    return RankInfo(tp_size, tp_rank, pools[0].page_size, n_target, len(layers) - n_target, tuple(layers),
                    tuple(groups), memory_type, agent_name, agent_metadata)


def check_peer(local: RankInfo, peer: RankInfo) -> None:
    """Raise PeerMismatchError unless ``local`` can READ its pages from ``peer``'s: byte for byte at equal TP
    size, as kv-head slices of the same layers between different TP sizes."""
    def differ(what: str, mine, theirs):
        raise PeerMismatchError(f"peer {peer.agent_name or '?'} rejected: {what} differs "
                                f"(this rank {mine}, peer {theirs})")

    if local.page_size != peer.page_size:
        differ("page size", local.page_size, peer.page_size)
    if local.page_layout != peer.page_layout:
        differ("order of the bytes in a page", local.page_layout, peer.page_layout)
    if local.num_target_layers != peer.num_target_layers:
        differ("number of target layers", local.num_target_layers, peer.num_target_layers)
    if local.num_draft_layers != peer.num_draft_layers:
        differ("number of draft layers", local.num_draft_layers, peer.num_draft_layers)
    theirs = peer.layer_map
    same_tp = local.tp_size == peer.tp_size
    for name, mine in local.layer_map.items():
        other = theirs.get(name)
        if other is None:
            differ("layer set", sorted(local.layer_map), sorted(theirs))
        for attr in ("dtype", "element_size", "head_dim") + (("num_kv_heads", "total_kv_heads") if same_tp else ()):
            if getattr(mine, attr) != getattr(other, attr):
                differ(f"layer {name} {attr.replace('_', ' ')}", getattr(mine, attr), getattr(other, attr))
    if same_tp:
        # Same layers with different groupings (unified vs separate pools) would move the wrong bytes.
        mine_groups = [(g.space, g.group, g.layers, g.page_stride) for g in local.groups]
        their_groups = [(g.space, g.group, g.layers, g.page_stride) for g in peer.groups]
        if mine_groups != their_groups:
            differ("page layout (spaces, groups, layers, page stride)", mine_groups, their_groups)
        return
    problem = _split_problem(local, peer)
    if problem:
        raise PeerMismatchError(f"peer {peer.agent_name or '?'} rejected: tensor-parallel size differs (this rank "
                                f"{local.tp_size}, peer {peer.tp_size}) and the split cannot be mapped: {problem}")


def _split_problem(local: RankInfo, peer: RankInfo) -> str | None:
    """Why ``local``'s kv-head slices cannot be read from ``peer`` ranks of another TP size (None: they can)."""
    theirs = peer.layer_map
    for name, mine in local.layer_map.items():
        other = theirs[name]
        if mine.total_kv_heads != other.total_kv_heads:
            return f"layer {name} has {mine.total_kv_heads} kv heads here, {other.total_kv_heads} at the peer"
        try:
            expected = kv_head_slice(other.total_kv_heads, peer.tp_size, peer.tp_rank)
        except ValueError as e:
            return f"layer {name}: {e}"
        if expected != (other.kv_head_start, other.num_kv_heads):
            return (f"layer {name}: peer rank {peer.tp_rank} of {peer.tp_size} says it holds kv heads "
                    f"[{other.kv_head_start}, {other.kv_head_start + other.num_kv_heads}), not {expected}")
    spaces_mine, spaces_theirs = _layer_spaces(local), _layer_spaces(peer)
    if spaces_mine != spaces_theirs:
        return f"layers sit in different page spaces (this rank {spaces_mine}, peer {spaces_theirs})"
    return None


def _layer_spaces(info: RankInfo) -> dict[str, int]:
    return {name: g.space for g in info.groups for name in g.layers}


@dataclass(frozen=True)
class HeadSlice:
    """Heads ``[remote_head, remote_head + num_heads)`` of a layer's pages at a peer rank go to heads
    ``[local_head, ...)`` of this rank's pages (indices within each rank's own pages)."""

    layer: str
    local_head: int
    remote_head: int
    num_heads: int


def shared_slices(local: RankInfo, peer: RankInfo) -> tuple[HeadSlice, ...]:
    """Every kv head ``local`` holds that ``peer`` holds too, per layer, as slices."""
    slices = []
    for layer in local.layers:
        other = peer.layer_map[layer.name]
        first = max(layer.kv_head_start, other.kv_head_start)
        end = min(layer.kv_head_start + layer.num_kv_heads, other.kv_head_start + other.num_kv_heads)
        if end > first:
            slices.append(HeadSlice(layer.name, first - layer.kv_head_start, first - other.kv_head_start, end - first))
    return tuple(slices)


def plan_reads(local: RankInfo, peers: Sequence[RankInfo]) -> list[tuple[int, tuple[HeadSlice, ...] | None]]:
    """Which of a peer replica's ranks ``local`` READs from, and what: ``(peer index, slices)``, slices None
    when that peer rank's pages are byte for byte the ones this rank needs (equal TP: whole pages, rank r from
    rank r). Each kv head comes from one peer rank holding it; replicated heads are spread over their holders."""
    for peer in peers:
        check_peer(local, peer)
    if len({p.tp_size for p in peers}) != 1 or len(peers) != peers[0].tp_size or \
            sorted(p.tp_rank for p in peers) != list(range(len(peers))):
        raise PeerMismatchError(f"the peer replica's rank list is incomplete: ranks {[p.tp_rank for p in peers]} "
                                f"of TP sizes {sorted({p.tp_size for p in peers})}")
    if peers[0].tp_size == local.tp_size:
        return [(next(i for i, p in enumerate(peers) if p.tp_rank == local.tp_rank), None)]
    by_peer: dict[int, list[HeadSlice]] = {}
    for layer in local.layers:
        for head in range(layer.kv_head_start, layer.kv_head_start + layer.num_kv_heads):
            holders = [i for i, p in enumerate(peers) if p.layer_map[layer.name].holds(head)]
            if not holders:
                raise PeerMismatchError(f"no peer rank holds kv head {head} of layer {layer.name}")
            source = holders[local.tp_rank % len(holders)]
            remote = head - peers[source].layer_map[layer.name].kv_head_start
            slices = by_peer.setdefault(source, [])
            last = slices[-1] if slices else None
            if last is not None and last.layer == layer.name and \
                    last.local_head + last.num_heads == head - layer.kv_head_start and \
                    last.remote_head + last.num_heads == remote:
                slices[-1] = HeadSlice(layer.name, last.local_head, last.remote_head, last.num_heads + 1)
            else:
                slices.append(HeadSlice(layer.name, head - layer.kv_head_start, remote, 1))
    return [(i, tuple(slices)) for i, slices in sorted(by_peer.items())]


__all__ = ["RANK_INFO_VERSION", "GroupInfo", "HeadSlice", "LayerInfo", "PeerMismatchError", "RankInfo", "check_peer",
           "describe_pools", "kv_head_slice", "plan_reads", "shared_slices"]
