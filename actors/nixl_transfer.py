"""A rank's NIXL agent (UCX backend): pool registration, peer registration, page READs, and held-page bookkeeping."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kv.pool import KVPool
from kv.rank_info import RankInfo, check_peer, describe_pools
from kv.spec import LayerOwner


class TransferError(RuntimeError):
    """A page READ failed or timed out; the request it carried fails."""


# Notifications a decode rank sends the prefill rank it read from: "the pages are read" or "I gave up on them".
READ_DONE, READ_CANCELLED = "read", "cancel"


def notification(kind: str, request_id: str) -> bytes:
    return f"{kind}:{request_id}".encode()


def parse_notification(msg: bytes) -> tuple[str, str]:
    kind, _, request_id = msg.decode().partition(":")
    if kind not in (READ_DONE, READ_CANCELLED) or not request_id:
        raise ValueError(f"unknown notification {msg!r}")
    return kind, request_id


def owners_for(transfer_draft_kv: bool) -> tuple[LayerOwner, ...]:
    return (LayerOwner.TARGET, LayerOwner.DRAFT) if transfer_draft_kv else (LayerOwner.TARGET,)


class NixlEndpoint:
    """One NIXL agent over one rank's pools. Every agent call holds a lock: the notification poller shares it."""

    def __init__(self, name: str, pools: Sequence[KVPool], *, tp_size: int = 1, tp_rank: int = 0):
        from nixl._api import nixl_agent, nixl_agent_config

        self.name = name
        self.pools = list(pools)
        self.memory_type = "VRAM" if self.pools[0].device.type == "cuda" else "DRAM"
        self.device_id = self.pools[0].device.index or 0
        self._lock = threading.Lock()
        self.agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
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
        with self._lock:
            if peer.agent_name not in self.peers:
                self.agent.add_remote_agent(peer.agent_metadata)
            self.peers[peer.agent_name] = peer
        return peer.agent_name

    def remove_peer(self, name: str) -> None:
        with self._lock:
            if self.peers.pop(name, None) is not None:
                self.agent.remove_remote_agent(name)

    def _descriptors(self, info: RankInfo, tables: Sequence[Sequence[int]], owners) -> list[tuple[int, int, int]]:
        """(address, length, device) per page region of ``tables`` (per space) in the rank ``info`` describes.

        Offsets come from this rank's own pools: registration checked that the peer's page layout is identical.
        """
        bases = {(g.space, g.group): (g.base_address, g.device_id, g.num_pages) for g in info.groups}
        descs = []
        for space, (pool, table) in enumerate(zip(self.pools, tables)):
            for page in table:
                if not 0 <= page < pool.num_pages:
                    raise TransferError(f"page {page} is outside space {space} of {info.agent_name} "
                                        f"({pool.num_pages} pages)")
            for group, offset, length in pool.page_regions(table, owners):
                base, device, _ = bases[(space, group)]
                descs.append((base + offset, length, device))
        return descs

    def read(self, peer_name: str, remote_tables: Sequence[Sequence[int]], local_tables: Sequence[Sequence[int]],
             owners: Sequence[LayerOwner], notif: bytes, timeout_s: float) -> int:
        """READ the peer's pages into ours (target and/or draft layers); returns the bytes moved.

        The peer gets ``notif`` when the READ completes. Raises TransferError on failure or timeout.
        """
        peer = self.peers.get(peer_name)
        if peer is None:
            raise TransferError(f"peer {peer_name!r} is not registered with {self.name}")
        if [len(t) for t in remote_tables] != [len(t) for t in local_tables]:
            raise TransferError(f"page counts differ: remote {[len(t) for t in remote_tables]}, "
                                f"local {[len(t) for t in local_tables]}")
        remote = self._descriptors(peer, remote_tables, owners)
        local = self._descriptors(self.rank_info, local_tables, owners)
        nbytes = sum(length for _, length, _ in local)
        try:
            with self._lock:
                local_descs = self.agent.get_xfer_descs(local, self.memory_type)
                remote_descs = self.agent.get_xfer_descs(remote, peer.memory_type)
                handle = self.agent.initialize_xfer("READ", local_descs, remote_descs, peer_name, notif)
                state = self.agent.transfer(handle)
        except Exception as e:      # nixl raises its own error types for invalid descriptors or peers
            raise TransferError(f"READ of {len(remote)} regions from {peer_name} could not start: {e}") from e
        deadline = time.monotonic() + timeout_s
        try:
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TransferError(f"READ from {peer_name} did not finish within {timeout_s:.1f}s")
                time.sleep(0.0002)
                with self._lock:
                    state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                raise TransferError(f"READ from {peer_name} failed (state {state})")
        finally:
            with self._lock:
                self.agent.release_xfer_handle(handle)
        return nbytes

    def send(self, peer_name: str, msg: bytes) -> None:
        with self._lock:
            self.agent.send_notif(peer_name, msg)

    def notifications(self) -> list[bytes]:
        with self._lock:
            notifs = self.agent.get_new_notifs()
        return [msg for msgs in notifs.values() for msg in msgs]

    def close(self) -> None:
        with self._lock:
            for name in list(self.peers):
                self.agent.remove_remote_agent(name)
            self.peers.clear()
            self.agent.deregister_memory(self._registered)


@dataclass
class HeldPages:
    request_id: str
    deadline: float


class HeldPagesBook:
    """Prefill pages waiting for a decode peer's READ: freed on its notification, on cancel, or at the deadline."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._held: dict[str, HeldPages] = {}
        self._lock = threading.Lock()
        self.num_read = self.num_timed_out = self.num_cancelled = 0

    def hold(self, request_id: str, timeout_s: float | None = None) -> None:
        with self._lock:
            self._held[request_id] = HeldPages(request_id, time.monotonic() + (timeout_s or self.timeout_s))

    def done(self, request_id: str, reason: str) -> bool:
        """Forget a held request; True when it was held (the caller frees its pages exactly once)."""
        with self._lock:
            if self._held.pop(request_id, None) is None:
                return False
            if reason == "read":
                self.num_read += 1
            elif reason == "timeout":
                self.num_timed_out += 1
            else:
                self.num_cancelled += 1
            return True

    def expired(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        with self._lock:
            return [h.request_id for h in self._held.values() if h.deadline <= now]

    def __len__(self) -> int:
        return len(self._held)
