"""Per rank: the actor that owns the rank's pool memory, its NIXL agent, peer checks, READs, and held-page frees."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import torch

from actors.memory import SegmentAllocator, SharedSegments
from actors.nixl_transfer import (READ_CANCELLED, READ_DONE, HeldPagesBook, NixlEndpoint, TransferError,
                                  notification, owners_for, parse_notification)
from kv.pool import KVPool
from kv.spec import KVLayerSpec

log = logging.getLogger(__name__)


class KVManagerActor:
    """Allocates the rank's segments, mirrors the worker's pools over them, and moves pages with NIXL.

    The page allocator stays in the worker's engine: this actor tells the worker which held request to
    release when a peer's READ notification arrives, the peer cancels, or the hold times out.
    """

    def __init__(self, name: str, *, device: str = "cpu", tp_size: int = 1, tp_rank: int = 0,
                 hold_timeout_s: float = 30.0, poll_interval_s: float = 0.002, num_threads: int = 1):
        torch.set_num_threads(num_threads)
        self.name = name
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.segments = SharedSegments(device, prefix=f"dflash-{name}")
        self.held = HeldPagesBook(hold_timeout_s)
        self.poll_interval_s = poll_interval_s
        self.endpoint: NixlEndpoint | None = None
        self.worker = None
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None

    def ping(self) -> float:
        return time.monotonic()

    # --- memory ---------------------------------------------------------------------------------
    def create_segment(self, nbytes: int):
        return self.segments.create(nbytes)

    def attach(self, worker, spaces: Sequence[Sequence[KVLayerSpec]], page_size: int, num_pages: Sequence[int]) -> str:
        """The worker built its pools over our segments: mirror them, register with NIXL, return RankInfo JSON."""
        allocate = SegmentAllocator(self.segments.tensors)
        device = self.segments.device
        pools = [KVPool(specs, page_size, n, device, allocate) for specs, n in zip(spaces, num_pages)]
        self.segments.unlink()     # both processes have mapped them; nothing is left in /dev/shm on a crash
        self.worker = worker
        self.endpoint = NixlEndpoint(self.name, pools, tp_size=self.tp_size, tp_rank=self.tp_rank)
        self._poller = threading.Thread(target=self._poll, name=f"{self.name}-notifs", daemon=True)
        self._poller.start()
        return self.endpoint.rank_info.to_json()

    def rank_info(self) -> str:
        return self.endpoint.rank_info.to_json()

    # --- peers ----------------------------------------------------------------------------------
    def register_peer(self, payload: str) -> str:
        """Check and add a peer (raises PeerMismatchError naming both values); returns its agent name."""
        return self.endpoint.add_peer(payload)

    # --- prefill side: held pages ---------------------------------------------------------------
    def hold(self, request_ids: Sequence[str], timeout_s: float | None = None) -> None:
        """The worker holds these requests' pages for a peer; free them on its READ notification or timeout.

        Called before the peer learns of the requests, so a notification never precedes its hold.
        """
        for request_id in request_ids:
            self.held.hold(request_id, timeout_s)

    def cancel(self, request_id: str) -> bool:
        """Free a held request's pages now (the prefill replica gave up on it)."""
        return self._release(request_id, READ_CANCELLED)

    def num_held(self) -> int:
        return len(self.held)

    def hold_stats(self) -> dict:
        return {"held": len(self.held), "read": self.held.num_read, "timed_out": self.held.num_timed_out,
                "cancelled": self.held.num_cancelled}

    def _release(self, request_id: str, reason: str) -> bool:
        if not self.held.done(request_id, reason):
            return False
        if reason != READ_DONE:
            log.warning("%s: freeing held pages of %s (%s)", self.name, request_id, reason)
        self.worker.release.remote(request_id)
        return True

    def _poll(self) -> None:
        """Background: READ notifications and hold deadlines free prefill pages off the request path."""
        while not self._stop.wait(self.poll_interval_s):
            try:
                for msg in self.endpoint.notifications():
                    kind, request_id = parse_notification(msg)
                    self._release(request_id, kind)
                for request_id in self.held.expired():
                    self._release(request_id, "timeout")
            except Exception:       # keep polling: one bad message must not leak every later request's pages
                log.exception("%s: notification poller", self.name)

    # --- decode side: READ ----------------------------------------------------------------------
    def read(self, request_id: str, peer_name: str, remote_tables: list[list[int]], local_tables: list[list[int]],
             transfer_draft_kv: bool = True, timeout_s: float = 10.0) -> dict:
        """READ one request's pages from the peer; returns ``{"bytes", "seconds"}`` or raises TransferError."""
        start = time.perf_counter()
        try:
            nbytes = self.endpoint.read(peer_name, remote_tables, local_tables, owners_for(transfer_draft_kv),
                                        notification(READ_DONE, request_id), timeout_s)
        except TransferError:
            # Tell the prefill rank to free its pages now; if even this cannot reach it, its hold times out.
            try:
                self.endpoint.send(peer_name, notification(READ_CANCELLED, request_id))
            except Exception:
                log.exception("%s: could not cancel %s at %s", self.name, request_id, peer_name)
            raise
        return {"bytes": nbytes, "seconds": time.perf_counter() - start}

    def close(self) -> None:
        self._stop.set()
        if self._poller is not None:
            self._poller.join(timeout=1.0)
        if self.endpoint is not None:
            self.endpoint.close()
        self.segments.close()


__all__ = ["KVManagerActor", "TransferError"]
