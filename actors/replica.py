"""The aggregated, prefill and decode replicas: the one implementation behind the Serve deployments and the
offline ``dflash-serve generate --mode agg|disagg`` alike.

A replica drives its rank group (``actors.worker``; rank 0's engine in a process of its own, reached through
``actors.engine_host.EngineClient``) and speaks in chunks (``actors.chunks``): plain dicts that cross Ray and
Serve. A disaggregated request is a
prefill (the whole prompt, in as many steps as it takes, first token sampled, pages held under a lease)
then a decode: the decode replica reserves pages, its KV manager READs the prefill pages under that
lease, and the engine starts decoding the request in the step after the READ ends.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import gc
import logging
import threading
from collections.abc import AsyncIterator, Sequence

from actors.chunks import Batcher, error_chunk
from actors.cpus import leave_engine_cpus, thread_cpus
from actors.engine_loop import EngineStopped
from actors.logs import configure_actor_logging
from actors.sink import SinkAddress
from actors.ticket import PrefillOffer, Ticket, handover
from actors.worker import HEALTH_PING_TIMEOUT_S, RankGroup, RankProblem, freeze_heap
from engine.llm import EngineConfig
from engine.llm_engine import LLMEngine, RequestOutput
from engine.sequence import Continuation, SamplingParams, SpecStats, TokenLogprob

log = logging.getLogger(__name__)
# Consecutive failed health checks after which Serve stops a replica (its REPLICA_HEALTH_CHECK_UNHEALTHY_THRESHOLD).
UNHEALTHY_CHECKS = 3

class EngineReplica:
    """What every role shares: the rank group, chunk streams, and inspection."""

    role = "aggregated"
    transfers = False

    def __init__(self, config: EngineConfig, *, tp_size: int = 1, num_threads: int = 1,
                 hold_timeout_s: float = 30.0, transfer_draft_kv: bool = True, read_timeout_s: float = 10.0,
                 reserve_timeout_s: float = 10.0, read_delay_s: float = 0.0, kv_transport: str = "auto",
                 stream_interval: int = 1, ticket_timeout_s: float = 300.0):
        configure_actor_logging()
        leave_engine_cpus()
        self.config = config
        self.ticket_timeout_s = ticket_timeout_s
        self.stream_interval = stream_interval
        self.transfer_draft_kv = transfer_draft_kv
        self.read_timeout_s = read_timeout_s
        self.reserve_timeout_s = reserve_timeout_s
        self.hold_timeout_s = hold_timeout_s
        self.group = RankGroup(self.role, config, transfers=self.transfers, tp_size=tp_size,
                               hold_timeout_s=hold_timeout_s, num_threads=num_threads, read_delay_s=read_delay_s,
                               kv_transport=kv_transport)
        self.replica_id = self.group.name
        self.engine = self.group.engine        # rank 0's engine, in its own process (``actors.engine_host``)
        freeze_heap()
        log.info("%s ready: %s with drafter %s, %s on %s, %d rank(s)", self.replica_id, config.model,
                 config.draft or "none", config.dtype, config.device, tp_size)

    async def ready(self) -> str:
        return self.replica_id

    async def thread_cpus(self) -> dict[str, list[list[int]]]:
        """(Inspection) The cores the threads of this replica's process and of its engine's may run on
        (``actors.cpus``)."""
        return {"replica": thread_cpus(), "engine": await self.group.host.thread_cpus.remote()}

    health_timeout_s = HEALTH_PING_TIMEOUT_S     # a rank's answer to a health check, at most
    failed_checks = 0           # health checks failed in a row

    async def check_health(self) -> None:
        """Raise when a rank cannot serve. Serve calls this periodically and replaces a replica that fails it
        (a new replica brings new rank actors). A rank gone for good fails the requests in flight at once
        (``lost_rank``); one that stopped answering (stalled, not dead) fails them at the check that has Serve
        stop the replica, whose shutdown would otherwise wait for streams that cannot end."""
        problems = await asyncio.to_thread(self.group.health_problems, self.health_timeout_s)
        if not problems:
            self.failed_checks = 0
            return
        self.failed_checks += 1
        self.lost_rank(problems)
        if self.failed_checks >= UNHEALTHY_CHECKS and not self.engine.failed:
            log.error("%s: a rank has not answered %d health checks, failing its requests: %s", self.replica_id,
                      self.failed_checks, "; ".join(map(str, problems)))
            self.engine.fail(EngineStopped(f"the {self.role} replica serving this request stopped answering; "
                                           "retry it"))
        raise RuntimeError(f"{self.replica_id} cannot serve: {'; '.join(map(str, problems))}")

    def lost_rank(self, problems: Sequence[RankProblem]) -> None:
        """When a rank is gone for good (a ``fatal`` problem; a rank slow to answer only fails this health check):
        stop serving at once. The requests in flight end with a retryable error, new ones are refused, and
        nothing more is computed (a dead KV manager's pool may be gone with it), so the replica's devices are
        free for the one replacing it."""
        fatal = [p for p in problems if p.fatal]
        if not fatal or self.engine.failed:
            return
        log.error("%s lost a rank, failing its requests: %s", self.replica_id, "; ".join(map(str, fatal)))
        self.engine.fail(EngineStopped(f"the {self.role} replica serving this request lost a process; retry it"))

    async def rank_infos(self) -> list[str]:
        return list(self.group.rank_infos)

    async def kv_managers(self) -> list:
        return list(self.group.kv_managers)

    async def gc_frozen(self) -> dict[str, int]:
        """Objects the garbage collector no longer walks (``actors.worker.freeze_heap``), in this process and in the
        engine's."""
        engine = await self.group.host.__ray_call__.remote(lambda _: gc.get_freeze_count())
        return {"replica": gc.get_freeze_count(), "engine": engine}

    async def pages_in_use(self) -> int:
        return await self.group.host.pages_in_use.remote()

    async def page_digest(self, tables: list[list[int]], owners: Sequence[str] = ("target", "draft")) -> str:
        return await self.group.host.page_digest.remote(tables, owners)

    def _local(self, sink: SinkAddress | None) -> SinkAddress | None:
        """``sink`` if the engine's process can send to it (it runs on this node), else None: this replica relays."""
        return sink if sink is not None and sink.node_id == self.engine.node_id else None

    async def _stream(self, request_id: str, queue: asyncio.Queue, **first_extra) -> AsyncIterator[dict]:
        """Chunks until the request finishes; what piled up while the consumer was busy goes as one chunk, and
        after the first tokens one goes every ``stream_interval`` steps (the last at once).
        A consumer that goes away first aborts the request (its pages are freed, or after a running READ)."""
        finished = False
        extra = first_extra
        batch = Batcher(self.stream_interval)
        try:
            while not finished:
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                for item in items:
                    if item["type"] == "ended":     # its chunks went straight to the caller's sink, the last too
                        batch.finished = True
                    if batch.finished or batch.add(item):
                        break
                finished = batch.finished
                chunk = batch.take()
                if chunk is None:
                    continue
                if extra and chunk["type"] == "tokens":
                    chunk.update(extra)
                    extra = {}
                yield chunk
        finally:
            if not finished:
                self.engine.abort(request_id)
            else:
                self.engine.close_stream(request_id)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       sink: SinkAddress | None = None, continuation: Continuation | None = None
                       ) -> AsyncIterator[dict]:
        """The request's chunks, its prompt and its decode on this replica's engine; with a ``sink`` on this node its
        token chunks go there instead, straight from the engine's process, and this stream carries only a refusal
        or failure (``actors.sink``). A prefill or a decode replica runs requests whole so while the other role has
        no replica that can serve (``serve_app.router``): its engine is a whole engine, drafter included. With
        ``continuation`` it goes on from the output it gave out on a replica that was lost (``Continuation``)."""
        try:
            queue = self.engine.open_stream(request_id)
        except ValueError as e:
            yield in_use(e)
            return
        try:
            refused = await self.engine.start(request_id, prompt_token_ids, params, sink=self._local(sink),
                                              continuation=continuation)
        except BaseException:       # cancelled while being added: it may have been added all the same
            self.engine.abort(request_id)
            raise
        if refused is not None:
            self.engine.close_stream(request_id)
            yield refused
            return
        async for chunk in self._stream(request_id, queue):
            yield chunk

    def shutdown(self) -> None:
        self.group.shutdown()
        gc.unfreeze()       # a process that goes on (a test run, a notebook) must collect what this replica held


class AggregatedReplica(EngineReplica):
    """Prefill and decode in one engine: no transfer."""

    async def generate_all(self, requests: Sequence[tuple[str, list[int], SamplingParams]]) -> list[RequestOutput]:
        """Every request at once (offline use); outputs in request order."""
        return list(await asyncio.gather(*(collect(rid, ids, self.generate(rid, ids, p)) for rid, ids, p in requests)))


def in_use(e: ValueError) -> dict:
    """The 400 for a request whose id another request streaming on the same replica has."""
    return error_chunk(400, str(e), "invalid_request_error")


class PrefillReplica(EngineReplica):
    """Runs whole prompts to their first token and holds the pages under a lease until a decode peer READs
    them, the lease is cancelled, or it expires."""

    role = "prefill"
    transfers = True

    def __init__(self, config: EngineConfig, **kwargs):
        super().__init__(config, **kwargs)
        self._releases: collections.Counter[str] = collections.Counter()    # request id -> ranks whose lease ended
        self._counting = threading.Lock()
        self.offer = PrefillOffer([self.group.agent_name(i) for i in range(len(self.group.kv_managers))],
                                  list(self.group.rank_infos), self.hold_timeout_s)
        for i, kvm in enumerate(self.group.kv_managers):
            threading.Thread(target=self._release_loop, args=(kvm,), daemon=True, name=f"release-{i}").start()

    def _release_loop(self, kv_manager) -> None:
        """Free the pages of every lease the KV manager ended (read, cancelled, expired); blocks while none."""
        import ray

        while True:
            try:
                request_ids = ray.get(kv_manager.wait_released.remote())
            except Exception:          # the KV manager is gone (shutdown or killed): nothing more to free
                return
            for request_id in request_ids:
                self._release(request_id)

    def _release(self, request_id: str) -> None:
        """Free a request's pages once every rank's lease on them has ended (the ranks' pages share rank 0's page
        ids, and a decode rank may still be reading another rank's)."""
        with self._counting:
            self._releases[request_id] += 1
            if self._releases[request_id] < len(self.group.kv_managers):
                return
            del self._releases[request_id]
        self.engine.release(request_id)

    async def prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      sink: SinkAddress | None = None) -> dict:
        """``{"ticket": Ticket}`` to continue on a decode replica, or ``{"chunk": ...}`` when the request
        ends here (its first token ends it, or it failed). The engine's process issues the ticket and sends the
        holds (``EngineHost._issue``); with a ``sink`` on this node it sends the result there, and this returns
        ``{"sent": True}`` once it went."""
        num_pages = -(-len(prompt_token_ids) // self.engine.page_size)
        try:
            queue = self.engine.open_stream(request_id)
        except ValueError as e:
            return {"chunk": in_use(e)}
        settled = False       # True once the pages are freed or held under a lease
        try:
            refused = await self.engine.start(
                request_id, prompt_token_ids, dataclasses.replace(params, max_tokens=1), hold_pages=True,
                on_finish=functools.partial(handover, request_id, list(prompt_token_ids), params, num_pages),
                sink=self._local(sink), offer=self.offer, ticket_params=params)
            if refused is not None:
                settled = True
                return {"chunk": refused}
            item = await queue.get()
            settled = True
            if item["type"] == "ended":
                return {"sent": True}
            if item["type"] == "prefilled":
                return {key: item[key] for key in ("ticket", "chunk") if key in item}
            return {"chunk": item}      # an error chunk: the engine's process failed
        finally:
            self.engine.close_stream(request_id)
            if not settled:
                self.engine.abort(request_id)

    async def prefill_stream(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                             sink: SinkAddress | None = None) -> AsyncIterator[dict]:
        """``prefill``'s result as a stream of one item: Serve delivers a streamed item to the calling deployment
        sooner than a unary reply (0.96-1.02 against 1.32-1.48 ms a round trip on a CPU host, side by side in one
        run of Serve's throughput mode), and the ingress waits for this one before the first token goes out."""
        yield await self.prefill(request_id, prompt_token_ids, params, sink)


def _reserve(request_id: str, prompt_token_ids: list[int], params: SamplingParams, num_pages: int,
             reuse_prefix: bool, e: LLMEngine):
    """On the decode engine's thread: the prompt's pages per space (reserved while the prefill runs: its first token
    comes with the ticket), how many leading ones are reused, and what the READ must wait for before writing into
    them (``LLMEngine.pages_settled``), or None while the pool lacks pages."""
    request = e.reserve_transfer(prompt_token_ids, None, params, request_id=request_id, reuse_prefix=reuse_prefix)
    if request is None:
        return None
    return ([e.kv.block_table(request_id, s)[:num_pages] for s in range(len(e.kv.pools))],
            request.num_reused_tokens // e.kv.page_size, e.pages_settled())


class DecodeReplica(EngineReplica):
    """Takes over prefilled requests. It is called as the prefill starts (``stand_by``): its engine's process
    reserves the prompt's pages meanwhile and waits for the ticket, which the ingress hands to that process
    directly; then it READs the pages with NIXL and streams DFlash (``EngineHost._do_stand_by``)."""

    role = "decode"
    transfers = True

    async def stand_by(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       sink: SinkAddress | None = None) -> AsyncIterator[dict]:
        """A chunk ``{"type": "standby", "host": name}`` once this replica's engine process stands by for the
        request's ticket (the caller hands it to the actor of that name: ``EngineHost.hand``), then the request's
        chunks: the first carries ``transfer``. The request waits for pages as TRANSFERRING, never scheduled and
        its pages never freed, behind older reservations while the pool is full (granted in the step that frees
        pages; no timer), then its KV is READ once the ticket has come, and it decodes from the step after the
        READ ends. With a ``sink`` on this node the request's chunks after ``standby`` go there (``generate``)."""
        async for chunk in self._decode(request_id, prompt_token_ids, params, sink=self._local(sink)):
            yield chunk

    async def decode(self, ticket: Ticket) -> AsyncIterator[dict]:
        """``stand_by`` for a prefilled request whose ticket is here already (the offline driver): the ticket goes
        to the engine's process over its socket, and no ``standby`` chunk is yielded."""
        async for chunk in self._decode(ticket.request_id, ticket.prompt_token_ids, ticket.params, ticket):
            yield chunk

    async def _decode(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      ticket: Ticket | None = None, sink: SinkAddress | None = None) -> AsyncIterator[dict]:
        try:
            queue = self.engine.open_stream(request_id)
        except ValueError as e:       # the lease is the other request's: left alone
            if ticket is not None:
                ticket.cancel()
            yield in_use(e)
            return
        sent = False
        try:
            num_pages = -(-len(prompt_token_ids) // self.engine.page_size)
            attempt = functools.partial(_reserve, request_id, list(prompt_token_ids), params, num_pages,
                                        self.transfer_draft_kv)
            try:
                refused = await self.engine.stand_by(request_id, params, attempt, self.transfer_draft_kv,
                                                     self.ticket_timeout_s, self.reserve_timeout_s,
                                                     self.read_timeout_s, sink=sink)
            except BaseException:      # cancelled while the command was on its way: the host may stand by already
                self.engine.abort(request_id)
                raise
            if refused is not None:
                yield refused
                return
            sent = True
        finally:
            if not sent:      # refused, or cancelled before the engine got it: nothing READs the prefill pages
                self.engine.close_stream(request_id)
                if ticket is not None:
                    ticket.cancel()
        try:
            if ticket is not None:
                self.engine.hand(ticket.handoff())
            else:
                yield {"type": "standby", "host": self.group.host_name}
        except BaseException:     # closed at the standby chunk (the caller went away): stop standing by
            self.engine.abort(request_id)
            raise
        async for chunk in self._stream(request_id, queue):
            yield chunk

    async def decode_all(self, tickets: Sequence[Ticket]) -> list[RequestOutput]:
        """Every ticket at once (offline use); outputs in ticket order."""
        return list(await asyncio.gather(*(collect(t.request_id, t.prompt_token_ids, self.decode(t))
                                           for t in tickets)))


class ChunkError(RuntimeError):
    """An error chunk, raised by ``collect``: ``status``, ``error_type`` and the message."""

    def __init__(self, chunk: dict):
        super().__init__(chunk["message"])
        self.status, self.error_type = chunk["status"], chunk.get("error_type", "server_error")


async def collect(request_id: str, prompt_token_ids: list[int], chunks: AsyncIterator[dict]) -> RequestOutput:
    """A whole chunk stream as one RequestOutput (raises ChunkError on an error chunk)."""
    token_ids: list[int] = []
    text = ""
    logprobs: list[TokenLogprob] | None = None
    last: dict = {}
    async for chunk in chunks:
        if chunk["type"] == "error":
            raise ChunkError(chunk)
        token_ids += chunk["token_ids"]
        text += chunk["text"]
        if "logprobs" in chunk:
            logprobs = (logprobs or []) + chunk["logprobs"]
        last = chunk
    spec = SpecStats(**last["spec"]) if last.get("spec") else SpecStats()
    return RequestOutput(request_id, list(prompt_token_ids), token_ids, text, True, last.get("finish_reason"),
                         last.get("num_cached_tokens", 0), spec, token_ids, text_delta=text, logprobs=logprobs,
                         new_logprobs=logprobs)
