"""A rank's NIXL agent (UCX backend): pool registration, peer registration and page READs.

The agent runs without NIXL's progress thread (it spins a core) and with UCX error handling off, so a
READ needs no progress from the side it reads: the prefill rank stays idle while a decode rank READs.
The reader drives progress by polling its transfer, backing off, from its own event loop.

Between replicas of different TP sizes a rank READs kv-head slices (``kv.rank_info.plan_reads``). A page keeps a
layer's K (then V) head-major, ``[kv_heads, page_size, head_dim]`` (``kv.pool``), so a slice of heads is one
contiguous fragment per page, layer and K/V: (heads in the slice) x page_size x head_dim x element size bytes,
built with numpy and coalesced where both sides are contiguous (K with V when the slice is every head on both
sides, and a page with the next).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from kv.pool import KVPool
from kv.rank_info import HeadSlice, RankInfo, check_peer, describe_pools, shared_slices
from kv.spec import LayerOwner


# UCX settings for pools in GPU memory, unless the environment sets them. UCX turns off cuda_ipc's GET
# (a READ) when it sees no NVLink between the devices, and then stages every READ through host memory (under
# 1 GB/s measured on an H200); between processes on one GPU, or GPUs behind PCIe, the IPC copy is the fast
# path. (A UCX_TLS without an active-message transport also needs the error handling mode "none", set below.)
VRAM_UCX_DEFAULTS = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}
READ_POLL_MAX_S = 1e-3     # the longest wait between two progress calls of a READ in flight


class TransferError(RuntimeError):
    """A page READ failed or timed out; the request it carried fails."""


def owners_for(transfer_draft_kv: bool) -> tuple[LayerOwner, ...]:
    return (LayerOwner.TARGET, LayerOwner.DRAFT) if transfer_draft_kv else (LayerOwner.TARGET,)


class NixlEndpoint:
    """One NIXL agent over one rank's pools; used from one thread (its KV manager's event loop)."""

    def __init__(self, name: str, pools: Sequence[KVPool], *, tp_size: int = 1, tp_rank: int = 0,
                 total_kv_heads: Mapping[str, int] | None = None):
        from nixl._api import nixl_agent, nixl_agent_config

        self.name = name
        self.pools = list(pools)
        self.memory_type = "VRAM" if self.pools[0].device.type == "cuda" else "DRAM"
        self.device_id = self.pools[0].device.index or 0
        if self.memory_type == "VRAM":
            for key, value in VRAM_UCX_DEFAULTS.items():
                os.environ.setdefault(key, value)       # read when the UCX backend starts, just below
        self.agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
        self.agent.create_backend("UCX", {"ucx_error_handling_mode": "none"})
        regions = [(g.buffer.data_ptr(), g.buffer.numel(), self.device_id, "") for pool in self.pools
                   for g in pool.groups]
        self._registered = self.agent.register_memory(regions, self.memory_type)
        self.rank_info = describe_pools(self.pools, tp_size=tp_size, tp_rank=tp_rank, device_id=self.device_id,
                                        memory_type=self.memory_type, agent_name=name,
                                        agent_metadata=self.agent.get_agent_metadata(),
                                        total_kv_heads=total_kv_heads)
        self.poll_max_s = READ_POLL_MAX_S
        self.max_descriptor_bytes = 0          # > 0: split larger coalesced regions into descriptors of this size
        self.peers: dict[str, RankInfo] = {}
        # Per peer: the kv-head slices this rank READs from it; None: whole pages (equal TP size).
        self.slices: dict[str, tuple[HeadSlice, ...] | None] = {}
        self._geometry = layer_geometry(self.rank_info)
        self._peer_geometry: dict[str, dict[str, LayerGeometry]] = {}

    def add_peer(self, payload: str) -> str:
        """Check a peer's RankInfo and load its agent metadata; returns its agent name."""
        peer = RankInfo.from_json(payload)
        check_peer(self.rank_info, peer)
        if peer.agent_name not in self.peers:
            self.agent.add_remote_agent(peer.agent_metadata)
        self.peers[peer.agent_name] = peer
        self._peer_geometry[peer.agent_name] = layer_geometry(peer)
        # Alone, a peer of another TP size gives the heads it shares with this rank; ``plan_reads`` over its
        # whole replica (``set_slices``) decides which of its ranks each head comes from.
        self.slices[peer.agent_name] = None if peer.tp_size == self.rank_info.tp_size else \
            shared_slices(self.rank_info, peer)
        return peer.agent_name

    def set_slices(self, name: str, slices: tuple[HeadSlice, ...] | None) -> None:
        self.slices[name] = slices

    def remove_peer(self, name: str) -> None:
        self.slices.pop(name, None)
        self._peer_geometry.pop(name, None)
        if self.peers.pop(name, None) is not None:
            self.agent.remove_remote_agent(name)

    def _regions(self, info: RankInfo, tables: Sequence[Sequence[int]], owners) -> list[tuple[int, int, int]]:
        """(address, length, device) per page region of ``tables`` (per space) in the rank ``info`` describes.

        Offsets come from this rank's own pools: registration checked that the peer's page layout is identical.
        """
        bases = {(g.space, g.group): (g.base_address, g.device_id) for g in info.groups}
        regions = []
        for space, (pool, table) in enumerate(zip(self.pools, tables)):
            for page in table:
                if not 0 <= page < pool.num_pages:
                    raise TransferError(f"page {page} is outside space {space} of {info.agent_name} "
                                        f"({pool.num_pages} pages)")
            for group, offset, length in pool.page_regions(table, owners):
                base, device = bases[(space, group)]
                regions.append((base + offset, length, device))
        return regions

    async def read(self, peer_name: str, remote_tables: Sequence[Sequence[int]],
                   local_tables: Sequence[Sequence[int]], owners: Sequence[LayerOwner], timeout_s: float,
                   delay_s: float = 0.0, op: str = "READ") -> tuple[int, int]:
        """READ the peer's pages into ours (target and/or draft layers); returns (bytes, descriptors).

        Regions adjacent on both sides go as one descriptor. Raises TransferError on failure or timeout;
        it returns or raises only once the READ can no longer write into the local pages.
        ``delay_s`` holds the READ open that long after posting it (fault injection for tests).
        ``op="WRITE"`` moves the same pages the other way, ours into the peer's (only benchmarks use it).
        """
        peer = self.peers.get(peer_name)
        if peer is None:
            raise TransferError(f"peer {peer_name!r} is not registered with {self.name}")
        if [len(t) for t in remote_tables] != [len(t) for t in local_tables]:
            raise TransferError(f"page counts differ: remote {[len(t) for t in remote_tables]}, "
                                f"local {[len(t) for t in local_tables]}")
        slices = self.slices.get(peer_name)
        if slices is None:
            local, remote = coalesce(self._regions(self.rank_info, local_tables, owners),
                                     self._regions(peer, remote_tables, owners))
            if self.max_descriptor_bytes:
                local, remote = split_regions(local, self.max_descriptor_bytes), \
                    split_regions(remote, self.max_descriptor_bytes)
            nbytes = sum(length for _, length, _ in local)
        else:
            wanted = {owner.value for owner in owners}
            chosen = [s for s in slices if peer.layer_map[s.layer].owner in wanted]
            local, remote = coalesce_arrays(*slice_regions(chosen, self._geometry, self._peer_geometry[peer_name],
                                                           local_tables, remote_tables, peer_name))
            nbytes = int(local[:, 1].sum())
            if not len(local):
                return 0, 0
        try:
            local_descs = self.agent.get_xfer_descs(local, self.memory_type)
            remote_descs = self.agent.get_xfer_descs(remote, peer.memory_type)
            handle = self.agent.initialize_xfer(op, local_descs, remote_descs, peer_name)
            state = self.agent.transfer(handle)
        except Exception as e:      # nixl raises its own error types for invalid descriptors or peers
            raise TransferError(f"READ of {len(remote)} regions from {peer_name} could not start: {e}") from e
        deadline = time.monotonic() + timeout_s
        wait = 0.0
        try:
            if delay_s:
                await asyncio.sleep(delay_s)
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TransferError(f"READ from {peer_name} did not finish within {timeout_s:.1f}s")
                # Back off from 20 us to ``poll_max_s``: fast READs end at once, long ones cost few wake-ups.
                wait = min(max(2 * wait, 2e-5), self.poll_max_s)
                await asyncio.sleep(wait)
                state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                raise TransferError(f"READ from {peer_name} failed (state {state})")
        finally:
            # Releasing a handle still in flight aborts the transfer; only then may the caller free pages.
            self.agent.release_xfer_handle(handle)
        return nbytes, len(local)

    def close(self) -> None:
        for name in list(self.peers):
            self.agent.remove_remote_agent(name)
        self.peers.clear()
        self.agent.deregister_memory(self._registered)


@dataclass(frozen=True)
class LayerGeometry:
    """Where one layer's pages sit in a rank's registered memory (from its RankInfo)."""

    space: int
    base: int                  # address of page 0 of the layer's group
    device: int
    page_stride: int
    num_pages: int
    offset: int                # bytes from a group page's start to this layer's K
    kv_bytes: int              # bytes of K (equal to V) of one page
    head_bytes: int            # one kv head's run in a page's K (or V): page_size x head dim x element size


def layer_geometry(info: RankInfo) -> dict[str, LayerGeometry]:
    """Every layer's geometry in the rank ``info`` describes (its groups list layers in page order)."""
    layers = info.layer_map
    out = {}
    for g in info.groups:
        per_layer = g.page_stride // len(g.layers)
        for slot, name in enumerate(g.layers):
            layer = layers[name]
            out[name] = LayerGeometry(g.space, g.base_address, g.device_id, g.page_stride, g.num_pages,
                                      slot * per_layer, per_layer // 2,
                                      info.page_size * layer.head_dim * layer.element_size)
    return out


def slice_regions(slices: Sequence[HeadSlice], local: Mapping[str, LayerGeometry], remote: Mapping[str, LayerGeometry],
                  local_tables: Sequence[Sequence[int]], remote_tables: Sequence[Sequence[int]], peer_name: str
                  ) -> tuple[np.ndarray, np.ndarray]:
    """``(address, length, device)`` rows, local and remote, of every head slice of every page pair (pages are
    head-major: a slice of a page's K or V is one run): ordered page, layer, K/V, so that rows adjacent in memory
    on both sides follow each other."""
    out_local, out_remote = [], []
    for space, (ltable, rtable) in enumerate(zip(local_tables, remote_tables)):
        mine = [s for s in slices if local[s.layer].space == space]
        if not mine or not ltable:
            continue
        lp, rp = np.asarray(ltable, dtype=np.int64), np.asarray(rtable, dtype=np.int64)
        per_side = []
        for geometry, pages, head_of in ((local, lp, lambda s: s.local_head), (remote, rp, lambda s: s.remote_head)):
            first = geometry[mine[0].layer]
            if pages.min() < 0 or pages.max() >= first.num_pages:
                raise TransferError(f"a page of {pages.tolist()} is outside space {space} "
                                    f"({first.num_pages} pages{'' if geometry is local else ' at ' + peer_name})")
            columns = []
            for s in mine:
                g = geometry[s.layer]
                # K's and V's runs of the slice inside a page, then one row per page.
                in_page = g.offset + np.arange(2) * g.kv_bytes + head_of(s) * g.head_bytes
                columns.append(g.base + pages[:, None] * g.page_stride + in_page[None])
            per_side.append(np.stack(columns, axis=1).reshape(-1))      # [page, slice, K/V]
        shape = (len(lp), len(mine), 2)
        lengths = np.broadcast_to(np.array([s.num_heads * local[s.layer].head_bytes for s in mine])[None, :, None],
                                  shape).reshape(-1)
        for side, geometry, addresses in ((out_local, local, per_side[0]), (out_remote, remote, per_side[1])):
            devices = np.broadcast_to(np.array([geometry[s.layer].device for s in mine])[None, :, None],
                                      shape).reshape(-1)
            side.append(np.stack([addresses, lengths, devices], axis=1))
    if not out_local:
        empty = np.zeros((0, 3), dtype=np.int64)
        return empty, empty
    return np.concatenate(out_local), np.concatenate(out_remote)


def coalesce_arrays(local: np.ndarray, remote: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``coalesce`` for row arrays ``(address, length, device)`` of equal lengths, without a Python loop."""
    if len(local) < 2:
        return local, remote
    ends_l, ends_r = local[:-1, 0] + local[:-1, 1], remote[:-1, 0] + remote[:-1, 1]
    joins = (ends_l == local[1:, 0]) & (ends_r == remote[1:, 0]) & (local[:-1, 2] == local[1:, 2]) \
        & (remote[:-1, 2] == remote[1:, 2])
    starts = np.flatnonzero(np.concatenate([[True], ~joins]))
    lengths = np.add.reduceat(local[:, 1], starts)
    merged_l, merged_r = local[starts].copy(), remote[starts].copy()
    merged_l[:, 1] = lengths
    merged_r[:, 1] = lengths
    return merged_l, merged_r


def split_regions(regions: Sequence[tuple[int, int, int]], size: int) -> list[tuple[int, int, int]]:
    """``(address, length, device)`` regions cut into pieces of at most ``size`` bytes, in order."""
    out = []
    for address, length, device in regions:
        for start in range(0, length, size):
            out.append((address + start, min(size, length - start), device))
    return out


def coalesce(local: list[tuple[int, int, int]], remote: list[tuple[int, int, int]]
             ) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """Merge consecutive region pairs that are contiguous on both sides into one descriptor pair."""
    out_local: list[list[int]] = []
    out_remote: list[list[int]] = []
    for (la, length, ld), (ra, rlength, rd) in zip(local, remote):
        if rlength != length:
            raise TransferError(f"region sizes differ: local {length}, remote {rlength}")
        if out_local:
            pl, pr = out_local[-1], out_remote[-1]
            if pl[0] + pl[1] == la and pr[0] + pr[1] == ra and pl[2] == ld and pr[2] == rd:
                pl[1] += length
                pr[1] += length
                continue
        out_local.append([la, length, ld])
        out_remote.append([ra, length, rd])
    return [tuple(x) for x in out_local], [tuple(x) for x in out_remote]
