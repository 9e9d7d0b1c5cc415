"""A rank's NIXL agent (UCX backend): pool registration, peer registration and page READs.

The agent runs without NIXL's progress thread (it spins a core) and with UCX error handling off, so a
READ needs no progress from the side it reads: the prefill rank stays idle while a decode rank READs.
The reader drives progress by polling its transfer, backing off, from its own event loop.

Between replicas of different TP sizes a rank READs kv-head slices (``kv.rank_info.plan_reads``). A page keeps a
layer's K (then V) head-major, ``[kv_heads, page_size, head_dim]`` (``kv.pool``), so a slice of heads is one
contiguous fragment per page, layer and K/V: (heads in the slice) x page_size x head_dim x element size bytes,
built with numpy and coalesced where both sides are contiguous (K with V when the slice is every head on both
sides, and a page with the next).

A peer whose pools share this rank's GPU can be mapped into this process (``map_peer``, CUDA IPC): the same
plan is then carried out by copies on the GPU (``copy_regions``) instead of a NIXL READ. Between two processes
on one H200, UCX's ``cuda_ipc`` READ of a prompt's pages ran at 0.06-0.24x of a device-to-device copy
(benchmarks/README.md); the leases and every check around a READ stay the same.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
import torch

from kv.device_tables import upload
from kv.pool import KVPool
from kv.rank_info import HeadSlice, RankInfo, check_peer, describe_pools, shared_slices
from kv.spec import LayerOwner


# UCX settings for pools in GPU memory, unless the environment sets them. UCX turns off cuda_ipc's GET
# (a READ) when it sees no NVLink between the devices, and then stages every READ through host memory (under
# 1 GB/s measured on an H200); between processes on one GPU, or GPUs behind PCIe, the IPC copy is the fast
# path. (A UCX_TLS without an active-message transport also needs the error handling mode "none", set below.)
VRAM_UCX_DEFAULTS = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}
READ_POLL_MAX_S = 1e-3     # the longest wait between two progress calls of a READ in flight
COPY_SPIN_S = 5e-4         # the longest a mapped copy is polled for before its wait sleeps


class TransferError(RuntimeError):
    """A page READ failed or timed out; the request it carried fails."""


class ReadPlan(NamedTuple):
    """``NixlEndpoint.plan``: the READ's ``(address, length, device)`` rows, local and remote, and for a mapped
    peer's few regions, the copies located in the segments: ``(local address, remote address, bytes)``."""

    local: np.ndarray
    remote: np.ndarray
    copies: list[tuple[int, int, int]] | None = None


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
        # Peers whose pools this process maps (same device): pages are copied from the mapping, not READ.
        self.mapped: dict[str, PoolMapping] = {}
        self._segments = [g.buffer.view(-1) for pool in self.pools for g in pool.groups]
        self.copy_spin_s = COPY_SPIN_S
        self._events: list = []        # finished copies' events, for reuse
        self._cuda = CudaRuntime.load() if self.memory_type == "VRAM" else None
        self._stream = None            # the copies' stream (the current one: this process runs nothing else)

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
        self.mapped.pop(name, None)
        self.slices.pop(name, None)
        self._peer_geometry.pop(name, None)
        if self.peers.pop(name, None) is not None:
            self.agent.remove_remote_agent(name)

    def map_peer(self, name: str, segments: Sequence[torch.Tensor]) -> None:
        """Copy from registered peer ``name`` through ``segments``, this process's mapping of its pool groups (in
        its RankInfo's group order), instead of NIXL READs."""
        self.mapped[name] = PoolMapping(self.peers[name], segments)

    def transport(self, peer_name: str) -> str:
        """How pages move from ``peer_name``: "ipc" (copied from this process's mapping) or "nixl"."""
        return "ipc" if peer_name in self.mapped else "nixl"

    def _regions(self, info: RankInfo, tables: Sequence[Sequence[int]], owners) -> np.ndarray:
        """``(address, length, device)`` rows, one per page and pool group of ``tables`` (per space), in the rank
        ``info`` describes: per space, per group, pages in table order.

        Offsets come from this rank's own pools: registration checked that the peer's page layout is identical.
        Page counts may differ (a prefill and a decode replica size their pools apart): ``info``'s bound a table.
        """
        bases = {(g.space, g.group): (g.base_address, g.device_id) for g in info.groups}
        sizes = {g.space: g.num_pages for g in info.groups}
        rows = []
        for space, (pool, table) in enumerate(zip(self.pools, tables)):
            pages = np.asarray(table, dtype=np.int64)
            bad = pages[(pages < 0) | (pages >= sizes[space])]
            if len(bad):
                raise TransferError(f"page {bad[0]} is outside space {space} of {info.agent_name} "
                                    f"({sizes[space]} pages)")
            for group, start, length in pool.page_spans(owners):
                base, device = bases[(space, group)]
                block = np.empty((len(pages), 3), dtype=np.int64)
                block[:, 0] = base + start + pages * pool.groups[group].page_stride
                block[:, 1] = length
                block[:, 2] = device
                rows.append(block)
        return np.concatenate(rows) if rows else np.zeros((0, 3), dtype=np.int64)

    def plan(self, peer_name: str, remote_tables: Sequence[Sequence[int]], local_tables: Sequence[Sequence[int]],
             owners: Sequence[LayerOwner]) -> ReadPlan:
        """What moving these pages (or this rank's kv-head slices of them) takes: ``(address, length, device)``
        rows, local and remote, regions adjacent on both sides coalesced. Remote addresses are the peer's own
        (NIXL), or this process's mapping of its pools (``map_peer``), whose few regions are located in the
        segments here already (a region outside them raises TransferError now)."""
        local, remote = self._rows(peer_name, remote_tables, local_tables, owners)
        mapping = self.mapped.get(peer_name)
        copies = None
        if mapping is not None and self._cuda is not None and len(local) < MANY_COPIES:
            local_rows, remote_rows = local.tolist(), remote.tolist()
            locate_few(local_rows, remote_rows, self._segments, mapping.segments)     # in bounds, or raise
            copies = [(la, ra, n) for (la, n, _), (ra, _, _) in zip(local_rows, remote_rows)]
        return ReadPlan(local, remote, copies)

    def _rows(self, peer_name: str, remote_tables: Sequence[Sequence[int]], local_tables: Sequence[Sequence[int]],
              owners: Sequence[LayerOwner]) -> tuple[np.ndarray, np.ndarray]:
        peer = self.peers.get(peer_name)
        if peer is None:
            raise TransferError(f"peer {peer_name!r} is not registered with {self.name}")
        if [len(t) for t in remote_tables] != [len(t) for t in local_tables]:
            raise TransferError(f"page counts differ: remote {[len(t) for t in remote_tables]}, "
                                f"local {[len(t) for t in local_tables]}")
        mapping = self.mapped.get(peer_name)
        slices = self.slices.get(peer_name)
        if slices is None:
            local, remote = coalesce_arrays(self._regions(self.rank_info, local_tables, owners),
                                            self._regions(mapping.info if mapping else peer, remote_tables, owners))
            if self.max_descriptor_bytes:
                local, remote = split_regions(local, self.max_descriptor_bytes), \
                    split_regions(remote, self.max_descriptor_bytes)
            return local, remote
        wanted = {owner.value for owner in owners}
        chosen = [s for s in slices if peer.layer_map[s.layer].owner in wanted]
        geometry = mapping.geometry if mapping else self._peer_geometry[peer_name]
        return coalesce_arrays(*slice_regions(chosen, self._geometry, geometry, local_tables, remote_tables,
                                              peer_name))

    async def read(self, peer_name: str, remote_tables: Sequence[Sequence[int]],
                   local_tables: Sequence[Sequence[int]], owners: Sequence[LayerOwner], timeout_s: float,
                   delay_s: float = 0.0, op: str = "READ", plan: ReadPlan | None = None,
                   split: dict[str, float] | None = None) -> tuple[int, int]:
        """READ the peer's pages into ours (target and/or draft layers); returns (bytes, descriptors: NIXL's, or
        the copies launched from a mapped peer).

        Raises TransferError on failure or timeout; it returns or raises only once the READ can no longer write
        into the local pages. ``delay_s`` holds the READ open that long after posting it (fault injection for
        tests). ``op="WRITE"`` moves the same pages the other way with NIXL, ours into the peer's (only
        benchmarks use it). ``plan``: ``self.plan(...)`` of the same arguments, made earlier (the reader plans
        while its lease check is in flight). ``split`` receives the seconds spent planning, posting and waiting.
        """
        split = {} if split is None else split
        if plan is None:
            start = time.perf_counter()
            plan = self.plan(peer_name, remote_tables, local_tables, owners)
            split["plan_s"] = time.perf_counter() - start
        local, remote = plan.local, plan.remote
        if not len(local):
            return 0, 0
        nbytes = int(local[:, 1].sum())
        mapping = self.mapped.get(peer_name)
        if mapping is not None and op == "READ":
            return nbytes, await self._copy(mapping, plan, delay_s, split)
        posted = time.perf_counter()
        peer = self.peers[peer_name]
        try:
            local_descs = self.agent.get_xfer_descs(local, self.memory_type)
            remote_descs = self.agent.get_xfer_descs(remote, peer.memory_type)
            handle = self.agent.initialize_xfer(op, local_descs, remote_descs, peer_name)
            state = self.agent.transfer(handle)
        except Exception as e:      # nixl raises its own error types for invalid descriptors or peers
            raise TransferError(f"READ of {len(remote)} regions from {peer_name} could not start: {e}") from e
        waiting = time.perf_counter()
        split["post_s"] = waiting - posted
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
            split["wait_s"] = time.perf_counter() - waiting
        return nbytes, len(local)

    async def _copy(self, mapping: PoolMapping, plan: ReadPlan, delay_s: float, split: dict[str, float]) -> int:
        """Copy the planned regions from a mapped peer on this rank's device; returns the copies launched. On a
        GPU a short copy is polled for, a long one waited for asleep (a blocking-sync event, in a thread): the
        event loop goes on serving leases meanwhile. A copy cannot be aborted, so there is no timeout: it ends."""
        device = self.pools[0].device
        posted = time.perf_counter()
        cuda = self._cuda
        # This process runs nothing else on the GPU: its current stream is the copies' own.
        if device.type == "cuda" and self._stream is None:
            self._stream = torch.cuda.current_stream(device)
        if plan.copies is not None and cuda is not None:        # located while planning
            launched = cuda.copy_all(plan.copies, self._stream.cuda_stream)
        else:
            launched = copy_regions(plan.local, plan.remote, self._segments, mapping.segments,
                                    None if cuda is None else (cuda, self._stream.cuda_stream))
        launch_s = time.perf_counter() - posted
        done = None
        if device.type == "cuda":
            done = self._events.pop() if self._events else torch.cuda.Event(blocking=True)
            if cuda is not None and done.cuda_event:
                cuda.record(done.cuda_event, self._stream.cuda_stream)
            else:       # torch creates an event's CUDA event at its first record
                done.record(self._stream)
        waiting = time.perf_counter()
        if delay_s:
            await asyncio.sleep(delay_s)
        if done is not None:
            # A prompt's pages copy in a fraction of a millisecond: poll for that long on this thread (a thread
            # hop and a blocking-sync wake-up cost about as much again), then sleep in a thread until the end.
            query = done.query if cuda is None else (lambda: cuda.query(done.cuda_event))
            spin_until = time.perf_counter() + self.copy_spin_s
            while not query() and time.perf_counter() < spin_until:
                pass
            if not query():
                await asyncio.to_thread(done.synchronize)
            self._events.append(done)
        split.update(post_s=waiting - posted, launch_s=launch_s, wait_s=time.perf_counter() - waiting)
        return launched

    def close(self) -> None:
        for name in list(self.peers):
            self.agent.remove_remote_agent(name)
        self.peers.clear()
        self.mapped.clear()
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
    """Merge consecutive row pairs (``(address, length, device)`` rows, local and remote) that are contiguous on
    both sides into one descriptor pair."""
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


def split_regions(regions: np.ndarray, size: int) -> np.ndarray:
    """``(address, length, device)`` rows cut into pieces of at most ``size`` bytes, in order."""
    out = []
    for address, length, device in regions.tolist():
        for start in range(0, length, size):
            out.append((address + start, min(size, length - start), device))
    return np.asarray(out, dtype=np.int64).reshape(-1, 3)


class PoolMapping:
    """A peer rank's pool groups mapped into this process (CUDA IPC on one device): its RankInfo and layer
    geometry with this process's addresses, so that a plan names memory this process can copy from."""

    def __init__(self, info: RankInfo, segments: Sequence[torch.Tensor]):
        if len(segments) != len(info.groups):
            raise TransferError(f"{info.agent_name}: {len(segments)} mapped segments for {len(info.groups)} "
                                "pool groups")
        groups = []
        for g, segment in zip(info.groups, segments):
            if segment.dtype != torch.uint8 or segment.numel() < g.page_stride * g.num_pages:
                raise TransferError(f"{info.agent_name}: the segment mapped for space {g.space} group {g.group} "
                                    f"has {segment.numel()} {segment.dtype} elements; its pages take "
                                    f"{g.page_stride * g.num_pages} bytes")
            groups.append(replace(g, base_address=segment.data_ptr()))
        self.segments = [segment.view(-1) for segment in segments]
        self.info = replace(info, groups=tuple(groups))
        self.geometry = layer_geometry(self.info)


MANY_COPIES = 8        # from this many equal regions between two segments on: one gather and one scatter


class CudaRuntime:
    """The CUDA runtime this process loaded (torch's), called directly for a mapped READ's few large copies and
    its event. In a KV-manager actor, whose thread is cold between requests, two ``copy_`` calls took 0.17 ms of
    host time on an H200 host (0.05 ms back to back) and the event record 0.08 ms more, for a 2,000-token
    prompt's pages that copy in 0.1 ms; a runtime call is a few microseconds of ctypes."""

    NOT_READY = 600          # cudaErrorNotReady

    def __init__(self, lib):
        self.lib = lib
        lib.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                        ctypes.c_void_p]
        lib.cudaEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.cudaEventQuery.argtypes = [ctypes.c_void_p]
        lib.cudaGetErrorString.restype = ctypes.c_char_p

    @classmethod
    def load(cls) -> CudaRuntime | None:
        """The runtime library mapped into this process, or None (no CUDA, or a runtime linked statically: the
        copies then go through torch)."""
        if not torch.cuda.is_available():
            return None
        torch.cuda.init()
        try:
            with open("/proc/self/maps") as maps:
                path = next((line.split()[-1] for line in maps if "/libcudart.so" in line), None)
            return None if path is None else cls(ctypes.CDLL(path))
        except (OSError, AttributeError):
            return None

    def _check(self, status: int, what: str) -> None:
        if status:
            raise TransferError(f"{what} failed: {self.lib.cudaGetErrorString(status).decode()}")

    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._check(self.lib.cudaMemcpyAsync(dst, src, nbytes, 3, stream), "cudaMemcpyAsync")    # 3: device to device

    def copy_all(self, copies: Sequence[tuple[int, int, int]], stream: int) -> int:
        """``(dst, src, bytes)`` copies in order; returns how many."""
        for dst, src, nbytes in copies:
            self.copy(dst, src, nbytes, stream)
        return len(copies)

    def record(self, event: int, stream: int) -> None:
        self._check(self.lib.cudaEventRecord(event, stream), "cudaEventRecord")

    def query(self, event: int) -> bool:
        status = self.lib.cudaEventQuery(event)
        if status != self.NOT_READY:
            self._check(status, "cudaEventQuery")
        return status != self.NOT_READY


def _locate(rows: np.ndarray, segments: Sequence[torch.Tensor], side: str) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the segment holding it and its byte offset there (TransferError for memory outside them)."""
    bases = np.array([s.data_ptr() for s in segments], dtype=np.int64)
    sizes = np.array([s.numel() for s in segments], dtype=np.int64)
    order = np.argsort(bases)
    position = np.searchsorted(bases[order], rows[:, 0], side="right") - 1
    index = order[np.maximum(position, 0)]
    offsets = rows[:, 0] - bases[index]
    if (position < 0).any() or (offsets + rows[:, 1] > sizes[index]).any():
        raise TransferError(f"a {side} region lies outside the mapped pools")
    return index, offsets


def copy_regions(local: np.ndarray, remote: np.ndarray, local_segments: Sequence[torch.Tensor],
                 remote_segments: Sequence[torch.Tensor], runtime: tuple[CudaRuntime, int] | None = None) -> int:
    """Copy each remote row's bytes to its local row (``(address, length, device)`` rows, as ``plan`` makes
    them, addresses inside the given uint8 segments); returns the copies launched. Between two segments, many
    regions of one length at offsets that are multiples of it (scattered whole pages, head slices) go as one
    gather and one scatter of rows; others one copy each, through ``runtime`` (the CUDA runtime and a stream)
    when given."""
    if len(local) < MANY_COPIES:
        return _copy_each(local.tolist(), remote.tolist(), local_segments, remote_segments, runtime)
    into, local_offsets = _locate(local, local_segments, "local")
    source, remote_offsets = _locate(remote, remote_segments, "remote")
    lengths = local[:, 1]
    launched = 0
    for dst_index, src_index in sorted(set(zip(into.tolist(), source.tolist()))):
        rows = np.flatnonzero((into == dst_index) & (source == src_index))
        dst, src = local_segments[dst_index], remote_segments[src_index]
        size = int(lengths[rows[0]])
        lo, ro = local_offsets[rows], remote_offsets[rows]
        if len(rows) >= MANY_COPIES and (lengths[rows] == size).all() and not (lo % size).any() \
                and not (ro % size).any():
            dst_rows = dst[:dst.numel() // size * size].view(-1, size)
            src_rows = src[:src.numel() // size * size].view(-1, size)
            # Row indices through pinned memory: a copy from pageable memory would wait for the stream to drain.
            at = upload((lo // size).tolist(), torch.int64, dst.device)
            take = upload((ro // size).tolist(), torch.int64, src.device)
            dst_rows.index_copy_(0, at, src_rows.index_select(0, take))
            launched += 2
            continue
        for row, d, r in zip(rows.tolist(), lo.tolist(), ro.tolist()):
            n = int(lengths[row])
            dst[d:d + n].copy_(src[r:r + n], non_blocking=True)
            launched += 1
    return launched


def locate_few(local: list, remote: list, local_segments: Sequence[torch.Tensor],
               remote_segments: Sequence[torch.Tensor]) -> list[tuple[tuple[torch.Tensor, int], tuple[torch.Tensor, int],
                                                                      int]]:
    """Per row of a few (a prompt's pages in runs; no numpy): its local and remote (segment, offset) and length;
    TransferError for a region outside the segments."""
    def find(segments, address, length, side):
        for segment in segments:
            offset = address - segment.data_ptr()
            if 0 <= offset and offset + length <= segment.numel():
                return segment, offset
        raise TransferError(f"a {side} region lies outside the mapped pools")

    return [(find(local_segments, la, n, "local"), find(remote_segments, ra, n, "remote"), n)
            for (la, n, _), (ra, _, _) in zip(local, remote)]


def _copy_each(local: list, remote: list, local_segments: Sequence[torch.Tensor],
               remote_segments: Sequence[torch.Tensor], runtime: tuple[CudaRuntime, int] | None = None) -> int:
    """``copy_regions`` for a few rows, every row located first."""
    copies = locate_few(local, remote, local_segments, remote_segments)
    if runtime is not None:
        cuda, stream = runtime
        for (dst, d), (src, r), n in copies:
            cuda.copy(dst.data_ptr() + d, src.data_ptr() + r, n, stream)
        return len(copies)
    for (dst, d), (src, r), n in copies:
        dst[d:d + n].copy_(src[r:r + n], non_blocking=True)
    return len(copies)
