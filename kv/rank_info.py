"""What one rank publishes to its disaggregation peers, and the checks a peer must pass to register.

``RankInfo`` travels as versioned JSON: a payload from a peer is parsed, never unpickled; the NIXL agent
metadata (bytes) is base64. Version 1 payloads predate draft layers and read as 0 draft layers.
TP: a rank publishes its own ``tp_rank`` and its pools' per-rank kv heads (``num_kv_heads / tp_size``, or 1
replicated head). Peers must agree on ``tp_size`` today; reading between different TP sizes (per-rank kv-head
slices) is the next step.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from kv.pool import KVPool
from kv.spec import LayerOwner, dtype_name

RANK_INFO_VERSION = 2


class PeerMismatchError(ValueError):
    """A peer's KV layout cannot exchange pages with this rank's; the message names both values."""


@dataclass(frozen=True)
class LayerInfo:
    owner: str              # "target" | "draft"
    layer_index: int
    dtype: str
    element_size: int
    num_kv_heads: int
    head_dim: int

    @property
    def name(self) -> str:
        return f"{self.owner}.{self.layer_index}"


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
    version: int = RANK_INFO_VERSION

    def __post_init__(self):
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
        if version not in (1, RANK_INFO_VERSION):
            raise ValueError(f"RankInfo version {version} is not supported (this build reads 1 and "
                             f"{RANK_INFO_VERSION})")
        try:
            layers = [dict(layer) for layer in data["layers"]]
            if version == 1:
                # Version 1 predates draft layers: every layer is a target layer.
                for layer in layers:
                    layer.setdefault("owner", "target")
            return cls(
                tp_size=int(data["tp_size"]), tp_rank=int(data["tp_rank"]), page_size=int(data["page_size"]),
                num_target_layers=int(data.get("num_target_layers", len(layers))),
                num_draft_layers=int(data.get("num_draft_layers", 0)),
                layers=tuple(LayerInfo(**layer) for layer in layers),
                groups=tuple(GroupInfo(**{**g, "layers": tuple(g["layers"])}) for g in data.get("groups", ())),
                memory_type=str(data.get("memory_type", "DRAM")),
                agent_name=str(data.get("agent_name", "")),
                agent_metadata=base64.b64decode(data.get("agent_metadata", ""), validate=True),
                version=RANK_INFO_VERSION,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed RankInfo payload: {e}") from None


def describe_pools(pools: Sequence[KVPool], *, tp_size: int = 1, tp_rank: int = 0,
                   base_addresses: Sequence[Sequence[int]] | None = None, device_id: int = 0,
                   memory_type: str = "DRAM", agent_name: str = "", agent_metadata: bytes = b"") -> RankInfo:
    """The RankInfo of a rank's page spaces; ``base_addresses[space][group]`` are the registered addresses."""
    layers, groups = [], []
    for space, pool in enumerate(pools):
        for spec in pool.specs:
            layers.append(LayerInfo(spec.owner.value, spec.layer_index, dtype_name(spec.dtype), spec.element_size,
                                    spec.num_kv_heads, spec.head_dim))
        for g, group in enumerate(pool.groups):
            base = base_addresses[space][g] if base_addresses is not None else group.buffer.data_ptr()
            groups.append(GroupInfo(space, g, int(base), device_id, group.page_stride, pool.num_pages,
                                    tuple(spec.name for spec in group.layers)))
    n_target = sum(1 for layer in layers if layer.owner == LayerOwner.TARGET.value)
    return RankInfo(tp_size, tp_rank, pools[0].page_size, n_target, len(layers) - n_target, tuple(layers),
                    tuple(groups), memory_type, agent_name, agent_metadata)


def check_peer(local: RankInfo, peer: RankInfo) -> None:
    """Raise PeerMismatchError unless ``peer``'s pages can be read into ``local``'s byte for byte."""
    def differ(what: str, mine, theirs):
        raise PeerMismatchError(f"peer {peer.agent_name or '?'} rejected: {what} differs "
                                f"(this rank {mine}, peer {theirs})")

    if local.tp_size != peer.tp_size:
        differ("tensor-parallel size", local.tp_size, peer.tp_size)
    if local.page_size != peer.page_size:
        differ("page size", local.page_size, peer.page_size)
    if local.num_target_layers != peer.num_target_layers:
        differ("number of target layers", local.num_target_layers, peer.num_target_layers)
    if local.num_draft_layers != peer.num_draft_layers:
        differ("number of draft layers", local.num_draft_layers, peer.num_draft_layers)
    theirs = peer.layer_map
    for name, mine in local.layer_map.items():
        other = theirs.get(name)
        if other is None:
            differ("layer set", sorted(local.layer_map), sorted(theirs))
        for attr in ("dtype", "element_size", "num_kv_heads", "head_dim"):
            if getattr(mine, attr) != getattr(other, attr):
                differ(f"layer {name} {attr.replace('_', ' ')}", getattr(mine, attr), getattr(other, attr))
    # Same layers with different groupings (unified vs separate pools) would move the wrong bytes.
    mine_groups = [(g.space, g.group, g.layers, g.page_stride) for g in local.groups]
    their_groups = [(g.space, g.group, g.layers, g.page_stride) for g in peer.groups]
    if mine_groups != their_groups:
        differ("page layout (spaces, groups, layers, page stride)", mine_groups, their_groups)


__all__ = ["RANK_INFO_VERSION", "GroupInfo", "LayerInfo", "PeerMismatchError", "RankInfo", "check_peer",
           "describe_pools"]
