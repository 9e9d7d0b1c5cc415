"""The engine-holding Serve deployments: aggregated, prefill and decode replicas.

Each replica process builds its engine in-process and drives it with an ``EngineLoop`` (the engine's
step loop streams per token; ``actors.worker.RankWorker`` runs whole batches to completion, which cannot
stream). Disaggregated replicas take their pool memory from a ``KVManagerActor`` (actors/), which owns
the NIXL agent: the prefill side holds pages until the decode side's READ notification, and the decode
side READs target and draft layers into pages it reserved.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator

import torch

from engine.llm_engine import RequestOutput
from engine.sequence import SamplingParams
from serve_app.config import ServiceConfig
from serve_app.engine_loop import EngineLoop
from serve_app.metrics import engine_snapshot, get_hub

log = logging.getLogger(__name__)
RESERVE_RETRY_S = 0.02
RESERVE_TIMEOUT_S = 10.0


def error_chunk(status: int, message: str, error_type: str = "server_error") -> dict:
    return {"type": "error", "status": status, "message": message, "error_type": error_type}


def token_chunk(out: RequestOutput, new_token_ids: list[int], **extra) -> dict:
    chunk = {"type": "tokens", "token_ids": list(new_token_ids), "text": out.text, "finished": out.finished,
             "finish_reason": out.finish_reason, "num_cached_tokens": out.num_cached_tokens, **extra}
    if out.finished:
        s = out.spec
        chunk["spec"] = {"num_drafts": s.num_drafts, "num_draft_tokens": s.num_draft_tokens,
                         "num_accepted_tokens": s.num_accepted_tokens,
                         "accepted_per_position": list(s.accepted_per_position),
                         "mean_acceptance_length": s.mean_acceptance_length}
    return chunk


class _Releases:
    """Stands in for a rank worker towards the KV manager: collects the held prefills it says to free."""

    def __init__(self):
        self._ids: list[str] = []

    def release(self, request_id: str) -> None:
        self._ids.append(request_id)

    def drain(self) -> list[str]:
        ids, self._ids = self._ids, []
        return ids


class EngineReplica:
    """What every role shares: the engine and its loop thread, a readiness probe, and the metrics reporter."""

    role = "aggregated"

    def __init__(self, service: dict, app_name: str = "dflash"):
        self.service = ServiceConfig.model_validate(service)
        torch.set_num_threads(self.service.model.num_threads)
        self.replica_id = f"{self.role}-{uuid.uuid4().hex[:8]}"
        self.config = self.service.model.engine_config()
        self.engine = self._build_engine()
        self.loop = EngineLoop(self.engine)
        self.num_awaiting_transfer = 0
        self._closed = threading.Event()
        self._hub = get_hub(app_name)
        self._reporter = threading.Thread(target=self._report, name="metrics-reporter", daemon=True)
        self._reporter.start()

    def _build_engine(self):
        from engine.llm import build_engine

        return build_engine(self.config)

    async def ready(self) -> dict:
        return {"replica": self.replica_id, "role": self.role}

    async def pages_in_use(self) -> int:
        return await self.loop.call(lambda engine: engine.kv.pages_in_use())

    def _report(self) -> None:
        while not self._closed.wait(self.service.metrics_report_interval_s):
            try:
                snap = self.loop.submit(lambda e: engine_snapshot(e, self.role, self.num_awaiting_transfer)
                                        ).result(timeout=10)
                self._hub.report.remote(self.replica_id, snap)
            except Exception:      # a missed report only ages the gauges; keep the replica serving
                log.exception("metrics report failed")

    async def _stream(self, request_id: str, queue: asyncio.Queue, first: dict | None = None) -> AsyncIterator[dict]:
        """Chunks from the engine until the request finishes; abort it if the consumer goes away first."""
        finished = False
        try:
            if first is not None:
                yield first
                if first.get("finished"):
                    finished = True
                    return
            while True:
                out = await queue.get()
                if isinstance(out, BaseException):
                    finished = True
                    yield error_chunk(500, f"engine step failed: {out}")
                    return
                finished = out.finished
                yield token_chunk(out, out.new_token_ids)
                if finished:
                    return
        finally:
            if finished:
                self.loop.close_stream(request_id)
            else:
                # Client disconnected (the generator is cancelled or closed): free the pages now.
                self.loop.abort(request_id)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
                       ) -> AsyncIterator[dict]:
        """Stream one request through this engine (aggregated: prefill and decode here)."""
        queue = self.loop.open_stream(request_id)
        try:
            await self.loop.call(lambda e: e.add_request(prompt_token_ids, params, request_id=request_id))
        except ValueError as e:
            self.loop.close_stream(request_id)
            yield error_chunk(400, str(e), "invalid_request_error")
            return
        async for chunk in self._stream(request_id, queue):
            yield chunk

    def __del__(self):
        self.shutdown()

    def shutdown(self) -> None:
        if getattr(self, "_closed", None) is None or self._closed.is_set():
            return
        self._closed.set()
        self.loop.shutdown()
        try:
            self._hub.forget.remote(self.replica_id)
        except Exception:
            pass


class AggregatedServer(EngineReplica):
    role = "aggregated"


class _TransferReplica(EngineReplica):
    """A replica whose pools live in a KVManagerActor's segments, registered with NIXL."""

    def _build_engine(self):
        import ray
        from ray.util import get_current_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from actors.kv_manager import KVManagerActor
        from actors.memory import map_segment
        from engine.llm import build_engine

        gpu = torch.device(self.config.device).type == "cuda"
        options = {"num_cpus": 0, "num_gpus": 0.1 if gpu else 0}
        pg = get_current_placement_group()
        if pg is not None:
            # Same bundle as this replica: on GPU both processes must see the GPU that holds the pool.
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)
        self.agent_name = f"serve-{self.replica_id}"
        self.kv_manager = ray.remote(KVManagerActor).options(**options).remote(
            self.agent_name, device=self.config.device, hold_timeout_s=self.service.hold_timeout_s,
            num_threads=self.service.model.num_threads)
        self.releases = ray.remote(_Releases).options(num_cpus=0).remote()
        engine = build_engine(self.config, allocate=lambda n: map_segment(
            ray.get(self.kv_manager.create_segment.remote(n))))
        pools = engine.kv.pools
        self.rank_info = ray.get(self.kv_manager.attach.remote(
            self.releases, [p.specs for p in pools], engine.kv.page_size, [p.num_pages for p in pools]))
        return engine

    def shutdown(self) -> None:
        super().shutdown()
        try:
            import ray
            ray.kill(self.kv_manager)
            ray.kill(self.releases)
        except Exception:
            pass


class PrefillServer(_TransferReplica):
    """Runs prompts to their first token and holds the pages until the decode side READs them."""

    role = "prefill"

    def __init__(self, service: dict, app_name: str = "dflash"):
        self._held: set[str] = set()
        self._held_lock = threading.Lock()
        super().__init__(service, app_name)
        self._releaser = threading.Thread(target=self._release_loop, name="held-releaser", daemon=True)
        self._releaser.start()

    def _release_loop(self) -> None:
        import ray

        while not self._closed.wait(0.02):
            with self._held_lock:
                if not self._held:
                    continue
            try:
                ids = ray.get(self.releases.drain.remote(), timeout=10)
            except Exception:
                log.exception("draining released prefills failed")
                continue
            for request_id in ids:
                with self._held_lock:
                    self._held.discard(request_id)
                self.loop.submit(lambda e, r=request_id: e.release(r))

    async def prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> dict:
        """``{"ticket": Ticket, "rank_infos": [...]}`` to continue on a decode replica, or the final ``chunk``."""
        from actors.replica import Ticket

        start = time.perf_counter()
        queue = self.loop.open_stream(request_id)
        first = dataclasses.replace(params, max_tokens=1)
        try:
            await self.loop.call(lambda e: e.add_request(prompt_token_ids, first, request_id=request_id,
                                                         hold_pages=True))
        except ValueError as e:
            self.loop.close_stream(request_id)
            return {"chunk": error_chunk(400, str(e), "invalid_request_error")}
        settled = False       # True once the pages are released or held for the decode side
        try:
            out = await queue.get()
            if isinstance(out, BaseException):
                return {"chunk": error_chunk(500, f"prefill failed: {out}")}
            ends = out.finish_reason == "stop" or params.max_tokens == 1
            if ends or out.finish_reason not in ("length", "stop"):
                self.loop.submit(lambda e: e.release(request_id))
                settled = True
                return {"chunk": token_chunk(out, out.token_ids)}
            page_size = self.engine.kv.page_size
            n_pages = -(-len(prompt_token_ids) // page_size)
            tables = await self.loop.call(
                lambda e: [e.kv.block_table(request_id, s)[:n_pages] for s in range(len(e.kv.pools))])
            with self._held_lock:
                self._held.add(request_id)
            # The hold is in place before the decode side hears of the request, so its READ notice finds it.
            await self.kv_manager.hold.remote([request_id], self.service.hold_timeout_s)
            settled = True
            ticket = Ticket(request_id, list(prompt_token_ids), params, out.token_ids[0], [self.agent_name], tables,
                            time.perf_counter() - start)
            return {"ticket": ticket, "rank_infos": [self.rank_info], "kv_manager": self.kv_manager}
        finally:
            self.loop.close_stream(request_id)
            if not settled:
                with self._held_lock:
                    self._held.discard(request_id)
                self.loop.abort(request_id)


class DecodeServer(_TransferReplica):
    """Takes over prefilled requests: checks the peer, reserves pages, READs them with NIXL, streams DFlash decode."""

    role = "decode"

    def __init__(self, service: dict, app_name: str = "dflash"):
        super().__init__(service, app_name)
        self._peers: set[str] = set()

    async def _connect(self, ticket, rank_infos: list[str]) -> None:
        agent = ticket.peer_agents[0]
        if agent not in self._peers:
            # PeerMismatchError (page size, layer counts, dtypes) propagates: the router fails the request.
            await self.kv_manager.register_peer.remote(rank_infos[0])
            self._peers.add(agent)

    async def _reserve(self, ticket) -> list[list[int]] | None:
        page_size = self.engine.kv.page_size
        n_pages = -(-len(ticket.prompt_token_ids) // page_size)

        def reserve(e):
            if e.reserve_transfer(ticket.prompt_token_ids, ticket.first_token, ticket.params,
                                  request_id=ticket.request_id) is None:
                return None
            return [e.kv.block_table(ticket.request_id, s)[:n_pages] for s in range(len(e.kv.pools))]

        deadline = time.monotonic() + RESERVE_TIMEOUT_S
        while True:
            tables = await self.loop.call(reserve)
            if tables is not None or time.monotonic() > deadline:
                return tables
            await asyncio.sleep(RESERVE_RETRY_S)     # pages free up as running requests finish

    async def decode(self, ticket, rank_infos: list[str], prefill_kv_manager=None) -> AsyncIterator[dict]:
        """Move the ticket's KV here and stream the rest of its tokens (the first chunk carries the transfer).

        Failing (or cancelled) before the READ starts, tell the prefill's KV manager to free its held pages
        now rather than at the hold timeout; a started READ notifies or cancels by itself.
        """
        request_id = ticket.request_id
        queue = self.loop.open_stream(request_id)
        self.num_awaiting_transfer += 1
        activated = read_started = False
        try:
            try:
                await self._connect(ticket, rank_infos)
            except Exception as e:
                yield error_chunk(500, f"decode replica refused the prefill peer: {e}")
                return
            try:
                tables = await self._reserve(ticket)
            except ValueError as e:
                yield error_chunk(400, str(e), "invalid_request_error")
                return
            if tables is None:
                yield error_chunk(503, "no decode KV pages free", "overloaded")
                return
            read_started = True
            try:
                stats = await self.kv_manager.read.remote(request_id, ticket.peer_agents[0], ticket.tables, tables,
                                                          self.service.transfer_draft_kv)
            except Exception as e:
                yield error_chunk(500, f"KV transfer from {ticket.peer_agents[0]} failed: {e}", "transfer_error")
                return
            draft = self.service.transfer_draft_kv
            out = await self.loop.call(lambda e: e.activate_transfer(request_id, draft_context=draft))
            activated = True
        finally:
            self.num_awaiting_transfer -= 1
            if not activated:
                self.loop.abort(request_id)
            if not read_started and prefill_kv_manager is not None:
                prefill_kv_manager.cancel.remote(request_id)
        first = token_chunk(out, out.new_token_ids, transfer={"bytes": stats["bytes"], "seconds": stats["seconds"]})
        async for chunk in self._stream(request_id, queue, first):
            yield chunk
