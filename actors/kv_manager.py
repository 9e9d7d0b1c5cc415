"""Per rank: the actor that owns the rank's pool memory, its NIXL agent, peer checks, READs, and held-page leases.

An async actor: every method runs on its event loop, so nothing here needs a lock, and an idle manager
sleeps in that loop (no polling thread, no NIXL progress thread).

Prefill side, a lease per held request: ``hold`` -> HELD (expires after the hold timeout) -> ``begin_read``
by the decode peer -> READING (cannot expire while the READ runs, beyond a generous deadline for a peer
that died mid-READ) -> ``end_read`` -> released. Between TP sizes several decode ranks may READ one prefill
rank's pages: each says so (``num_readers``) and names itself, and the lease is released once every one of
them has ended its READ. A lease that expired or was cancelled refuses ``begin_read``. The READ is posted while
its ``begin_read`` is in flight (sent by the reader, or by the decode engine's process for all its ranks at
once) and its bytes are used only if the lease is granted: a lease still held
when its check arrives was held since the prefill, so during the READ too; a refused READ's bytes (the pages may
have been freed, even reused) are discarded. Released requests reach
the replica through ``wait_released``, a call that returns when there are some.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from actors.channel import ChannelServer
from actors.cpus import leave_engine_cpus
from actors.logs import configure_actor_logging
from actors.memory import PoolExport, SegmentAllocator, SharedSegments, device_uuid, map_segment
from actors.nixl_transfer import NixlEndpoint, TransferError, owners_for
from kv.pool import KVPool
from kv.rank_info import plan_reads
from kv.spec import KVLayerSpec

log = logging.getLogger(__name__)
READ_DEADLINE_MARGIN_S = 5.0
HOLD_ARRIVAL_S = 5.0          # how long a READ waits for a hold its ticket overtook
EARLY_CANCEL_TTL_S = 120.0
# "auto": pages from a peer whose pools are on this rank's GPU are copied from this process's CUDA IPC mapping of
# them (NIXL's cuda_ipc READ ran at 0.06-0.24x of a device copy there); from any other peer NIXL READs them.
# "nixl": NIXL always.
TRANSPORTS = ("auto", "nixl")
# How often a reader checks that the peers it READs from are alive: a dead one (its replica was replaced or
# scaled away) is forgotten, its NIXL metadata and any mapping of its pools dropped.
PEER_CHECK_S = 10.0


class LeaseState(enum.Enum):
    HELD = "held"
    READING = "reading"


@dataclass
class Lease:
    request_id: str
    state: LeaseState
    timer: asyncio.TimerHandle
    cancel_after_read: bool = False
    num_readers: int = 1                                   # decode ranks that READ it (set by the first)
    hold_s: float = 30.0                                   # how long it stays HELD unread (``renew`` restarts it)
    reading: set[str] = field(default_factory=set)         # readers whose READ runs
    done: set[str] = field(default_factory=set)            # readers whose READ has ended


class KVManagerActor:
    """Allocates the rank's segments, mirrors the worker's pools over them, and moves pages: NIXL READs, or copies
    from a peer whose pools share this rank's GPU (``transport``).

    The page allocator stays in the worker's engine: this actor only says which held requests to release.
    """

    def __init__(self, name: str, *, device: str = "cpu", tp_size: int = 1, tp_rank: int = 0,
                 hold_timeout_s: float = 30.0, read_deadline_s: float = 120.0, num_threads: int = 1,
                 read_delay_s: float = 0.0, transport: str = "auto", peer_check_s: float = PEER_CHECK_S):
        configure_actor_logging()
        leave_engine_cpus()
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        torch.set_num_threads(num_threads)
        self.name = name
        self.transport = transport
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.segments = SharedSegments(device, prefix=f"dflash-{name}")
        self.hold_timeout_s = hold_timeout_s
        self.read_deadline_s = read_deadline_s
        self.read_delay_s = read_delay_s       # > 0 only in tests: holds each READ open (a slow transfer)
        self.endpoint: NixlEndpoint | None = None
        self._leases: dict[str, Lease] = {}
        self._arrivals: dict[str, asyncio.Event] = {}           # begin_read waiting for its hold
        self._early_cancels: dict[str, asyncio.TimerHandle] = {}  # cancels that came before their hold
        self._released_leases: collections.deque[str] = collections.deque(maxlen=4096)
        self._peer_managers: dict[str, object] = {}            # peer agent -> its KV manager (decode side)
        self._reading_from: collections.Counter[str] = collections.Counter()   # READs in flight per peer
        self.peer_check_s = peer_check_s
        self._peer_watch: asyncio.Task | None = None
        self._released: list[str] = []
        self._released_event = asyncio.Event()
        # Leases ended by their READ, the hold timeout or a cancel; READs refused (the lease had ended); cancels
        # that came after the lease had ended (a client gone right after its READ).
        self.counts = {"read": 0, "timed_out": 0, "cancelled": 0, "refused": 0, "after_release": 0, "renewed": 0}
        # The hand-off's calls (the decode engine's READs and lease checks, the prefill replica's holds) come over a
        # channel from processes on this node (``actors.channel``), as Ray actor calls from any other.
        self._channel = ChannelServer(self, ("read", "begin_read", "end_read", "hold", "cancel"), "kv")

    def ping(self) -> float:
        return time.monotonic()

    async def channel_info(self) -> dict:
        return await self._channel.info()

    def channel_calls(self) -> int:
        """Calls that came over the channel so far (tests: the hand-off took it)."""
        return self._channel.calls

    # --- memory ---------------------------------------------------------------------------------
    def create_segment(self, nbytes: int):
        return self.segments.create(nbytes)

    def attach(self, spaces: Sequence[Sequence[KVLayerSpec]], page_size: int, num_pages: Sequence[int],
               total_kv_heads: dict[str, int] | None = None) -> str:
        """The worker built its pools over our segments: mirror them, register with NIXL, return RankInfo JSON.
        ``total_kv_heads``: per layer name, its kv heads over all ranks (this rank holds its share)."""
        allocate = SegmentAllocator(self.segments.tensors)
        device = self.segments.device
        pools = [KVPool(specs, page_size, n, device, allocate) for specs, n in zip(spaces, num_pages)]
        self.segments.unlink()     # both processes have mapped them; nothing is left in /dev/shm on a crash
        self.endpoint = NixlEndpoint(self.name, pools, tp_size=self.tp_size, tp_rank=self.tp_rank,
                                     total_kv_heads=total_kv_heads)
        return self.endpoint.rank_info.to_json()

    def rank_info(self) -> str:
        return self.endpoint.rank_info.to_json()

    # --- peers ----------------------------------------------------------------------------------
    async def register_peer(self, payload: str, peer_kv_manager=None) -> str:
        """Check and add a peer (raises PeerMismatchError naming both values); returns its agent name. A peer
        this rank will READ from comes with its KV manager's handle (for the lease calls, and its pools' CUDA
        IPC handles when they share this rank's GPU)."""
        agent = self.endpoint.add_peer(payload)
        if peer_kv_manager is not None:
            self._peer_managers[agent] = peer_kv_manager
            if self._peer_watch is None or self._peer_watch.done():
                self._peer_watch = asyncio.get_running_loop().create_task(self._watch_peers())
            if self.transport == "auto" and self.segments.device.type == "cuda" and agent not in self.endpoint.mapped:
                await self._map_peer(agent, peer_kv_manager)
        return agent

    async def _map_peer(self, agent: str, peer_kv_manager) -> None:
        """Map a peer's pools when they live on this rank's GPU; otherwise its pages go by NIXL (the READ stats
        and ``dflash_kv_transfers_total`` name the transport either way)."""
        export: PoolExport | None = await peer_kv_manager.export_pools.remote()
        mine = device_uuid(self.segments.device)
        if export is None or export.device_uuid != mine:
            log.info("%s: %s's pools are not on this GPU: NIXL moves its pages", self.name, agent)
            return
        try:
            self.endpoint.map_peer(agent, [map_segment(h, self.segments.device.index or 0) for h in export.handles])
        except Exception:     # e.g. a container that forbids CUDA IPC between these processes
            log.warning("%s: mapping %s's pools failed: NIXL moves its pages", self.name, agent, exc_info=True)
            return
        log.info("%s: %s's pools share this GPU: pages are copied from their CUDA IPC mapping", self.name, agent)

    async def _watch_peers(self) -> None:
        """Every ``peer_check_s`` while there are peers to READ from: forget those whose KV manager died."""
        from ray.exceptions import ActorDiedError

        while self._peer_managers:
            await asyncio.sleep(self.peer_check_s)
            agents = list(self._peer_managers)
            answers = await asyncio.gather(*(self._peer_managers[a].ping.remote() for a in agents),
                                           return_exceptions=True)
            for agent, answer in zip(agents, answers):
                # Only a death is final (a peer slow to answer is asked again); a READ still running keeps it.
                if isinstance(answer, ActorDiedError) and not self._reading_from[agent]:
                    self.forget_peer(agent)

    def forget_peer(self, agent: str) -> None:
        """Drop a peer: its KV manager's handle, its NIXL metadata and any mapping of its pools."""
        self._peer_managers.pop(agent, None)
        self._reading_from.pop(agent, None)
        self.endpoint.remove_peer(agent)
        log.info("%s: forgot peer %s (its KV manager is gone)", self.name, agent)

    def peer_names(self) -> list[str]:
        return sorted(self.endpoint.peers)

    def export_pools(self) -> PoolExport | None:
        """This rank's pool segments' CUDA IPC handles, for a reader on the same node (None for host memory)."""
        return self.segments.export()

    async def register_peers(self, payloads: Sequence[str], peer_kv_managers: Sequence) -> list[int]:
        """Register every rank of a peer replica and plan this rank's READs from them (raises
        PeerMismatchError, with the reason, for a split that cannot be mapped); returns the peer ranks (indices
        into ``payloads``) this rank READs from."""
        names = [await self.register_peer(payload, kvm) for payload, kvm in zip(payloads, peer_kv_managers)]
        plan = plan_reads(self.endpoint.rank_info, [self.endpoint.peers[name] for name in names])
        for index, slices in plan:
            self.endpoint.set_slices(names[index], slices)
        return [index for index, _ in plan]

    # --- prefill side: leases on held pages ------------------------------------------------------
    async def hold(self, request_id: str, lease_id: str, timeout_s: float | None = None) -> str:
        """Hold a finished prefill's pages for a peer under ``lease_id`` (chosen by the replica, so it need not
        wait for this call: a ``begin_read`` that arrives first waits for it)."""
        hold_s = timeout_s or self.hold_timeout_s
        timer = asyncio.get_running_loop().call_later(hold_s, self._expire, lease_id)
        self._leases[lease_id] = Lease(request_id, LeaseState.HELD, timer, hold_s=hold_s)
        arrived = self._arrivals.pop(lease_id, None)
        if arrived is not None:
            arrived.set()
        if self._early_cancels.pop(lease_id, None) is not None:
            self._release(lease_id, "cancelled")
        return lease_id

    async def renew(self, lease_id: str) -> bool:
        """The request whose pages a lease holds is alive and its READ not begun yet (its decode side is queued, or
        waits for pages): an unread lease's hold timer starts again. False once the lease is gone (expired,
        cancelled or read); True for a lease being READ (its READ deadline runs) or whose hold has not arrived."""
        lease = self._leases.get(lease_id)
        if lease is None:
            return lease_id not in self._released_leases and lease_id not in self._early_cancels
        if lease.state == LeaseState.HELD:
            lease.timer.cancel()
            lease.timer = asyncio.get_running_loop().call_later(lease.hold_s, self._expire, lease_id)
            self.counts["renewed"] += 1
        return True

    async def begin_read(self, lease_id: str, read_timeout_s: float | None = None, reader: str = "",
                         num_readers: int = 1) -> bool:
        """Peer rank ``reader``, one of ``num_readers``, is about to READ this lease's pages: True while they are
        held (then they cannot expire) and no reader has cancelled them."""
        if lease_id not in self._leases and lease_id not in self._early_cancels and \
                lease_id not in self._released_leases:
            # The replica sends the hold and the ticket at once: the ticket's READ may overtake the hold.
            arrived = self._arrivals.setdefault(lease_id, asyncio.Event())
            try:
                await asyncio.wait_for(arrived.wait(), HOLD_ARRIVAL_S)
            except asyncio.TimeoutError:
                self._arrivals.pop(lease_id, None)
        lease = self._leases.get(lease_id)
        if lease is None or reader in lease.reading or reader in lease.done or lease.cancel_after_read or \
                (lease.state == LeaseState.READING and num_readers != lease.num_readers):
            self.counts["refused"] += 1
            return False
        lease.timer.cancel()
        lease.state = LeaseState.READING
        lease.num_readers = num_readers
        lease.reading.add(reader)
        # Only for a reader that dies mid-READ. A READ never writes here, and a reader past its own timeout has
        # failed the request, so once that has passed (plus a margin) freeing cannot hand anyone foreign KV.
        deadline = self.read_deadline_s if read_timeout_s is None else min(self.read_deadline_s,
                                                                            read_timeout_s + READ_DEADLINE_MARGIN_S)
        lease.timer = asyncio.get_running_loop().call_later(deadline, self._expire, lease_id)
        return True

    async def end_read(self, lease_id: str, reader: str = "") -> None:
        """Peer rank ``reader``'s READ has ended (done or failed): once every reader's has, the pages may go."""
        lease = self._leases.get(lease_id)
        if lease is None or reader not in lease.reading:
            return
        lease.reading.discard(reader)
        lease.done.add(reader)
        if len(lease.done) >= lease.num_readers or (lease.cancel_after_read and not lease.reading):
            self._release(lease_id, "cancelled" if lease.cancel_after_read else "read")

    async def cancel(self, lease_id: str) -> bool:
        """Give up a lease: freed now if held, after the READ if one is running, at once on arrival if its
        hold has not arrived yet."""
        lease = self._leases.get(lease_id)
        if lease is None:
            if lease_id in self._released_leases:       # nothing left to give back
                self.counts["after_release"] += 1
            else:
                # Remembered a while: a hold that never comes (its replica died) must not pin memory.
                loop = asyncio.get_running_loop()
                self._early_cancels[lease_id] = loop.call_later(EARLY_CANCEL_TTL_S, self._early_cancels.pop,
                                                                lease_id, None)
            return False
        if lease.reading:
            lease.cancel_after_read = True
        else:       # held, or every READ begun so far has ended (a reader failed before beginning its own)
            self._release(lease_id, "cancelled")
        return True

    def _expire(self, lease_id: str) -> None:
        if lease_id in self._leases:
            state = self._leases[lease_id].state
            log.warning("%s: lease %s expired %s; freeing its pages", self.name, lease_id,
                        "unread" if state == LeaseState.HELD else "mid-READ (its reader is gone)")
            self._release(lease_id, "timed_out")

    def _release(self, lease_id: str, reason: str) -> None:
        lease = self._leases.pop(lease_id)
        lease.timer.cancel()
        self._released_leases.append(lease_id)
        self.counts[reason] += 1
        self._released.append(lease.request_id)
        self._released_event.set()

    async def wait_released(self) -> list[str]:
        """Request ids whose held pages the replica must free now; waits until there is at least one."""
        while not self._released:
            self._released_event.clear()
            await self._released_event.wait()
        released, self._released = self._released, []
        return released

    def hold_stats(self) -> dict:
        return {"held": sum(lease.state == LeaseState.HELD for lease in self._leases.values()),
                "reading": sum(lease.state == LeaseState.READING for lease in self._leases.values()),
                **self.counts}

    # --- decode side: READ ----------------------------------------------------------------------
    async def read(self, lease_id: str | None, peer_name: str, remote_tables: list[list[int]],
                   local_tables: list[list[int]], transfer_draft_kv: bool = True, timeout_s: float = 10.0,
                   num_readers: int = 1) -> dict:
        """READ one request's pages (or this rank's kv-head slices of them) from the registered peer under its
        lease, one of ``num_readers`` ranks reading it; returns stats or raises TransferError. Returns or raises
        only once the READ can no longer write into ``local_tables``. ``lease_id`` None: the caller checks the
        lease (``begin_read`` and ``end_read`` with this manager's name) and keeps the bytes only if granted."""
        start = time.perf_counter()
        peer_kv_manager = self._peer_managers.get(peer_name)
        if peer_kv_manager is None:
            raise TransferError(f"{peer_name} was not registered with its KV manager")
        lease_check = None if lease_id is None else \
            peer_kv_manager.begin_read.remote(lease_id, timeout_s, self.name, num_readers)
        owners = owners_for(transfer_draft_kv)
        split = {}
        plan_start = time.perf_counter()
        try:
            plan = self.endpoint.plan(peer_name, remote_tables, local_tables, owners)
        except Exception:       # nothing READ: the lease, if granted, ends here
            if lease_check is not None and await lease_check:
                peer_kv_manager.end_read.remote(lease_id, self.name)
            raise
        split["plan_s"] = time.perf_counter() - plan_start
        # The READ starts now, while the lease check is in flight. Its bytes are used only if the check grants the
        # lease: a lease still held when its check arrives has been held since the prefill, so during the READ too
        # (and from then on it cannot expire before ``end_read``). Refused, the READ may have copied pages that
        # were freed, even reused: they are discarded. The pages it writes into are this request's until it ends.
        self._reading_from[peer_name] += 1
        reading = asyncio.ensure_future(self._timed_read(peer_name, remote_tables, local_tables, owners, timeout_s,
                                                         plan, split))
        granted = lease_check is None
        try:
            if lease_check is not None:
                granted = await lease_check
            lease_end = time.perf_counter()
            if granted:
                nbytes, descriptors, read_start, end = await reading
        finally:
            await asyncio.wait({reading})       # returns or raises only once the READ can no longer write here
            if not granted and not reading.cancelled():
                reading.exception()              # retrieved: a refused READ's outcome does not matter
            self._reading_from[peer_name] -= 1
            if granted and lease_check is not None:
                peer_kv_manager.end_read.remote(lease_id, self.name)
        if not granted:
            raise TransferError(f"the prefill hold {lease_id} at {peer_name} expired or was cancelled before "
                                "its READ")
        # seconds: the READ alone, from its start to the pages landing (in ``split``: planning, posting, waiting);
        # lease_seconds: the lease check (one call to the peer), which runs alongside the planning and the READ
        return {"bytes": nbytes, "descriptors": descriptors, "seconds": end - read_start,
                "lease_seconds": lease_end - start, "transport": self.endpoint.transport(peer_name), "split": split}

    async def _timed_read(self, peer_name, remote_tables, local_tables, owners, timeout_s, plan, split):
        """The READ, with when it started and when its pages had landed."""
        start = time.perf_counter()
        nbytes, descriptors = await self.endpoint.read(peer_name, remote_tables, local_tables, owners, timeout_s,
                                                       self.read_delay_s, plan=plan, split=split)
        return nbytes, descriptors, start, time.perf_counter()

    def close(self) -> None:
        self._channel.close()
        if self._peer_watch is not None:
            self._peer_watch.cancel()
        for lease in self._leases.values():
            lease.timer.cancel()
        self._leases.clear()
        if self.endpoint is not None:
            self.endpoint.close()
        self.segments.close()


__all__ = ["KVManagerActor", "TransferError"]
