"""A rank's NIXL agent (UCX backend): pool registration, peer registration and page READs.

The agent runs without NIXL's progress thread (it spins a core) and with UCX error handling off, so a
READ needs no progress from the side it reads: the prefill rank stays idle while a decode rank READs.
The reader drives progress by polling its transfer, backing off, from its own event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from kv.pool import KVPool
from kv.rank_info import RankInfo, check_peer, describe_pools
from kv.spec import LayerOwner


class TransferError(RuntimeError):
    """A page READ failed or timed out; the request it carried fails."""


def owners_for(transfer_draft_kv: bool) -> tuple[LayerOwner, ...]:
    return (LayerOwner.TARGET, LayerOwner.DRAFT) if transfer_draft_kv else (LayerOwner.TARGET,)


class NixlEndpoint:
    """One NIXL agent over one rank's pools; used from one thread (its KV manager's event loop)."""

    def __init__(self, name: str, pools: Sequence[KVPool], *, tp_size: int = 1, tp_rank: int = 0):
        from nixl._api import nixl_agent, nixl_agent_config

        self.name = name
        self.pools = list(pools)
        self.memory_type = "VRAM" if self.pools[0].device.type == "cuda" else "DRAM"
        self.device_id = self.pools[0].device.index or 0
        self.agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
        self.agent.create_backend("UCX", {"ucx_error_handling_mode": "none"})
        regions = [(g.buffer.data_ptr(), g.buffer.numel(), self.device_id, "") for pool in self.pools
                   for g in pool.groups]
        self._registered = self.agent.register_memory(regions, self.memory_type)
        self.rank_info = describe_pools(self.pools, tp_size=tp_size, tp_rank=tp_rank, device_id=self.device_id,
                                        memory_type=self.memory_type, agent_name=name,
                                        agent_metadata=self.agent.get_agent_metadata())
        self.peers: dict[str, RankInfo] = {}

    def add_peer(self, payload: str) -> str:
        """Check a peer's RankInfo and load its agent metadata; returns its agent name."""
        peer = RankInfo.from_json(payload)
        check_peer(self.rank_info, peer)
        if peer.agent_name not in self.peers:
            self.agent.add_remote_agent(peer.agent_metadata)
        self.peers[peer.agent_name] = peer
        return peer.agent_name

    def remove_peer(self, name: str) -> None:
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
                   delay_s: float = 0.0) -> tuple[int, int]:
        """READ the peer's pages into ours (target and/or draft layers); returns (bytes, descriptors).

        Regions adjacent on both sides go as one descriptor. Raises TransferError on failure or timeout;
        it returns or raises only once the READ can no longer write into the local pages.
        ``delay_s`` holds the READ open that long after posting it (fault injection for tests).
        """
        peer = self.peers.get(peer_name)
        if peer is None:
            raise TransferError(f"peer {peer_name!r} is not registered with {self.name}")
        if [len(t) for t in remote_tables] != [len(t) for t in local_tables]:
            raise TransferError(f"page counts differ: remote {[len(t) for t in remote_tables]}, "
                                f"local {[len(t) for t in local_tables]}")
        local, remote = coalesce(self._regions(self.rank_info, local_tables, owners),
                                 self._regions(peer, remote_tables, owners))
        nbytes = sum(length for _, length, _ in local)
        try:
            local_descs = self.agent.get_xfer_descs(local, self.memory_type)
            remote_descs = self.agent.get_xfer_descs(remote, peer.memory_type)
            handle = self.agent.initialize_xfer("READ", local_descs, remote_descs, peer_name)
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
                # Back off from 20 us to 1 ms: fast READs end at once, long ones cost few wake-ups.
                wait = min(max(2 * wait, 2e-5), 1e-3)
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
