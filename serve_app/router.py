"""The prefill/decode router: one request's chunk stream, through one aggregated replica or a prefill then a decode.

Serve's handles pick the replicas (power of two choices over queue lengths), the prefill and the decode one at once;
the decode replica's engine process registers the prefill peer named in the ticket on first sight, so any decode
replica can take any prefill's ticket.

While one of the two roles has no replica that can serve (none healthy, as the metrics hub says, or its only one
failed a call as unavailable, ``Router.whole_on``), a request runs whole on a replica of the other role, whose
engine computes its prompt as an aggregated one does: a lost prefill replica costs no request while Serve replaces
it (nor a lost decode replica: the prefill replica decodes then).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import AsyncIterator

from actors.channel import ActorLink
from actors.chunks import Batcher, ended_chunk, error_chunk
from actors.sink import ChunkSink
from actors.worker import rank_actor
from engine.sequence import Continuation, SamplingParams

log = logging.getLogger(__name__)


# How long a request whose replica stream ended waits for its last chunk on the sink (sent before that end).
LAST_CHUNK_S = 10.0
# How long a role whose call failed as unavailable (its replica lost a process, or is gone) is passed over: its
# replica leaves within about two seconds, and the hub, which also names a role without a healthy replica, drops a
# dead one at once (``MetricsHub.watch``) but one on a lost node only once its reports are stale
# (``serve_app.metrics.STALE_REPORTS``); a replacement takes longer.
DOWN_S = 10.0
ROLES = ("prefill", "decode")
# While a request waits for its prefill's result or its decode call's first chunk, how often the router asks
# whether that role can still serve: Serve holds a call to a replica that died until a replacement is up (tens of
# seconds to minutes), and such a request is given up as unavailable and sent again, whole on the other role.
WATCH_S = 0.5


class Router:
    def __init__(self, backends: dict, on_transfer=None, sink: ChunkSink | None = None, stream_interval: int = 1,
                 on_chunk=None, healthy=None, on_whole=None, clock=time.monotonic):
        self.backends = backends
        self.disaggregated = "prefill" in backends
        # Healthy replicas per role, as the metrics hub last said (the ingress's view; None: not known), and a
        # role's call per request run whole on it (``whole_on``).
        self.healthy = healthy or (lambda: None)
        self.on_whole = on_whole or (lambda role: None)
        self._clock = clock
        # role -> when a call to it last failed as unavailable, and its healthy replicas then (the hub's view)
        self._failed_at: dict[str, tuple[float, int]] = {}
        # With a sink, the engine processes on this node send the requests' token chunks straight to it
        # (``actors.sink``), a step's at a time, and the replicas' streams carry only refusals and failures.
        self.sink = sink
        self.stream_interval = stream_interval
        # Called with "sink" or "replica" per token chunk (and per prefill result) that came here.
        self.on_chunk = on_chunk or (lambda path: None)
        # Called with the decode's transfer stats (and ``handoff_s``: from the prefill's result here to the decode
        # side's first output here), or None on failure.
        self.on_transfer = on_transfer
        self._waiting: dict[asyncio.Future, str] = {}     # what requests wait on, and from which role (``_watching``)
        self._watcher: asyncio.Task | None = None
        self._handing: set[asyncio.Task] = set()      # tickets on their way to decode engine processes, and drops
        self._hosts: dict[str, ActorLink] = {}        # links to those processes by name (channels on this node)

    async def stream(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     continuation: Continuation | None = None) -> AsyncIterator[dict]:
        """Chunks (``token_chunk``/``error_chunk`` dicts); closing the iterator cancels the replica's work. With
        ``continuation`` (a stream whose replica was lost after it gave out tokens) the request goes on from them,
        whole on one replica: of the role that can serve while the other cannot, else a decode replica (its KV is
        computed again there, with the output given out)."""
        sink = queue = None
        if self.sink is not None:
            sink, queue = await self.sink.address(), self.sink.open(request_id)
        try:
            if continuation is not None:
                role = self.whole_on() if self.disaggregated else "aggregated"
                if role is not None and self.disaggregated:
                    self.on_whole(role)
                chunks = self._whole(role or "decode", request_id, prompt_token_ids, params, sink, queue,
                                     continuation)
            else:
                chunks = self._stream(request_id, prompt_token_ids, params, sink, queue)
            async for chunk in chunks:
                yield chunk
        finally:
            if self.sink is not None:
                self.sink.close(request_id)

    def whole_on(self) -> str | None:
        """The role to run a request whole on: the other one while prefill or decode cannot serve, else None (both
        can, or neither: the request goes the usual way, and fails as unavailable). A role cannot serve while it
        has no healthy replica, or while its only one failed a call as unavailable in the last ``DOWN_S`` and the
        hub has not dropped it since (of several, Serve routes around the one that failed)."""
        if not self.disaggregated:
            return None
        now, healthy = self._clock(), self.healthy()

        def down(role: str) -> bool:
            replicas = 1 if healthy is None else healthy.get(role, 0)
            failed = self._failed_at.get(role)
            if failed is not None and (now - failed[0] >= DOWN_S or replicas < failed[1]):
                del self._failed_at[role]       # long ago, or the hub no longer counts the replica that failed
                failed = None
            return replicas == 0 or (replicas == 1 and failed is not None)

        serving = [role for role in ROLES if not down(role)]
        return serving[0] if len(serving) == 1 else None

    def _failed(self, role: str, failure: dict | BaseException) -> None:
        """Note a call to ``role`` that failed (an error chunk, or the exception its call raised): one that says
        the replica cannot serve passes the role over (``whole_on``)."""
        if failure.get("error_type") == "unavailable" if isinstance(failure, dict) else unavailable(failure):
            healthy = self.healthy()
            replicas = 1 if healthy is None else healthy.get(role, 0)
            if replicas == 0:       # the hub says so already (a mark would outlast its replacement's coming)
                return
            if role not in self._failed_at:
                log.warning("a %s replica cannot serve; while it has no other, requests run whole on %s replicas",
                            role, next(r for r in ROLES if r != role))
            self._failed_at[role] = (self._clock(), replicas)

    async def _whole(self, role: str, request_id: str, prompt_token_ids: list[int], params: SamplingParams, sink,
                     queue, continuation: Continuation | None = None) -> AsyncIterator[dict]:
        """The request on one replica of ``role``, prompt and decode (``EngineReplica.generate``)."""
        args = (request_id, prompt_token_ids, params, sink) + ((continuation,) if continuation is not None else ())
        gen = self.backends[role].options(stream=True).generate.remote(*args)
        chunks = self._relayed(gen) if sink is None else self._through_sink(request_id, gen, queue)
        async for chunk in self._noting(role, chunks) if self.disaggregated else chunks:
            yield chunk

    async def _stream(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, sink, queue
                      ) -> AsyncIterator[dict]:
        role = "aggregated" if not self.disaggregated else self.whole_on()
        if role is not None:
            if self.disaggregated:
                self.on_whole(role)
            async for chunk in self._whole(role, request_id, prompt_token_ids, params, sink, queue):
                yield chunk
            return
        # The decode call goes out with the prefill: its replica's engine process reserves the prompt's pages while the
        # prefill runs and stands by; its first chunk names that process, to which the ticket goes in one call (over a
        # channel on one node) the moment both are here, not through Serve's routing after the prefill. The prefill's
        # result comes as a stream of one item (sooner than a unary reply). Awaiting it can be cancelled by a
        # disconnect: the prefill call is cancelled then, and its replica aborts the request and frees its pages. The
        # decode call is made apart from the request (Serve would cancel it with the request, and can lose a cancel that
        # comes before the call has started): this generator ends it itself.
        prefill = self.backends["prefill"].options(stream=True).prefill_stream.remote(request_id, prompt_token_ids,
                                                                                      params, sink)
        prefill = _only_item(prefill) if sink is None else self._prefilled(request_id, prefill, queue)
        decode = _StandBy(self, request_id, contextvars.Context().run(
            self.backends["decode"].options(stream=True).stand_by.remote, request_id, prompt_token_ids, params, sink))
        ticket, completed, keep = None, False, None
        try:
            try:
                result = await self._watching("prefill", prefill)
            except Exception as e:      # (a disconnect's cancellation is no failure of the replica)
                self._failed("prefill", e)
                raise
            if result is None:
                result = {"chunk": error_chunk(503, f"request {request_id}: no prefill replica can serve it",
                                               "unavailable")}
            if "chunk" in result:       # the request ends with its first token (or failed): no decode
                if result["chunk"]["type"] == "error":
                    self._failed("prefill", result["chunk"])
                # Stopped before the last chunk goes out: a consumer may stop reading at it.
                decode.drop()
                completed = True
                yield result["chunk"]
                return
            ticket, ticket_at = result["ticket"], time.perf_counter()
            decode.hand(ticket)
            # Under load the decode call may wait for a replica slot, and then for pages, longer than the prefill
            # holds the prompt's pages: they are kept held while this request waits, until its first decode chunk.
            keep = asyncio.ensure_future(ticket.keep_held())
            # The first token goes out now, while its KV moves (unless it could still be cut by a stop string or
            # end the request, which only the decode side's output settles).
            early = ticket.first_text is not None
            if early:
                yield ticket.first_chunk()
            first = True
            async for chunk in self._noting("decode", decode.chunks(queue)):
                keep.cancel()
                if first and self.on_transfer is not None:
                    if chunk["type"] == "tokens" and chunk.get("transfer") is not None:
                        self.on_transfer({**chunk["transfer"], "handoff_s": time.perf_counter() - ticket_at})
                    elif chunk.get("error_type") == "transfer_error":
                        self.on_transfer(None)
                if first and early and chunk["type"] == "tokens":
                    chunk = ticket.after_first(chunk)
                if chunk["type"] == "tokens" and chunk["finished"]:
                    chunk = ticket.with_prefill_timing(chunk)
                first = False
                # The last chunk ends the request: a consumer that stops reading after it (and leaves this
                # generator to be closed when collected) cancels nothing.
                completed = _last(chunk)
                if completed and not decode.handed:     # refused before the ticket went anywhere: nothing READs it
                    ticket.cancel()
                yield chunk
            completed = True
        finally:
            if keep is not None:
                keep.cancel()
            if not completed:
                # Closed early (a disconnect, the prefill's failure), maybe before the decode replica ever ran:
                # stop the decode call, and give the held pages back now rather than at the hold timeout. After a
                # READ has begun that only marks the lease.
                decode.drop()
                if ticket is not None:
                    ticket.cancel()

    async def _watching(self, role: str, awaitable):
        """``awaitable``'s result, or None once ``role`` cannot serve while it waits (``whole_on`` names the other
        role; ``_watch`` looks every ``WATCH_S``): it is cancelled then. Cancelled itself (a disconnect), it
        cancels ``awaitable``."""
        task = asyncio.ensure_future(awaitable)
        self._waiting[task] = role
        if self._watcher is None or self._watcher.done():
            # In a context of its own: not this request's task (its cancellation must not cancel the watch).
            self._watcher = asyncio.get_running_loop().create_task(self._watch(), context=contextvars.Context())
        try:
            return await task
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():     # this request's own cancellation
                raise
            return None     # given up by ``_watch``
        finally:
            del self._waiting[task]

    async def _watch(self) -> None:
        """While requests wait on a role (``_watching``): every ``WATCH_S``, give up those that wait on a role
        that cannot serve. One loop for them all, not a timer per request on its way to the first token."""
        while self._waiting:
            await asyncio.sleep(WATCH_S)
            serving = self.whole_on()
            if serving is None:
                continue
            for task, role in list(self._waiting.items()):
                if role != serving and not task.done():
                    log.warning("a request waited for a %s replica that cannot serve; giving it up", role)
                    task.cancel()

    async def _noting(self, role: str, chunks: AsyncIterator[dict]) -> AsyncIterator[dict]:
        """``chunks`` of a call to ``role``, its failures noted (``_failed``)."""
        try:
            async for chunk in chunks:
                if chunk["type"] == "error":
                    self._failed(role, chunk)
                yield chunk
        except Exception as e:
            self._failed(role, e)
            raise

    async def _through_sink(self, request_id: str, gen, queue: asyncio.Queue) -> AsyncIterator[dict]:
        """A request's chunks from the sink (``queue``: its queue there), merged with what its replica's
        stream ``gen`` brings (a refusal, a failure); what piled up goes as one chunk, and after the first tokens
        one goes every ``stream_interval`` steps (the last at once). Closed before the last chunk (a disconnect),
        it cancels the replica's call, which aborts the request."""
        pump = asyncio.ensure_future(_pump(gen, queue, self.on_chunk))
        finished = False
        try:
            batch, ended = Batcher(self.stream_interval), False
            while not finished:
                try:
                    items = [await (asyncio.wait_for(queue.get(), LAST_CHUNK_S) if ended else queue.get())]
                except asyncio.TimeoutError:
                    items = [error_chunk(502, f"request {request_id}: its replica's stream ended without its last "
                                              "chunk", "server_error")]
                while not queue.empty():
                    items.append(queue.get_nowait())
                for item in items:
                    if isinstance(item, BaseException):     # the replica's call failed (Serve raises it)
                        finished = True
                        raise item
                    if item["type"] == "ended":     # the replica's stream ended: its last chunk is here or coming
                        ended = True
                        continue
                    if item["type"] == "tokens" and not item.pop("relayed", False):
                        self.on_chunk("sink")
                    if batch.add(item):
                        break
                finished = batch.finished
                # The last chunk ends the request: a consumer that stops reading after it cancels nothing.
                chunk = batch.take()
                if chunk is not None:
                    yield chunk
        finally:
            if finished:        # the replica's call ends by itself: let it (a cancel now would abort nothing)
                self._keep(pump)
            else:
                pump.cancel()
                gen.cancel()

    async def _prefilled(self, request_id: str, gen, queue: asyncio.Queue) -> dict:
        """The prefill's result (``{"ticket": ...}`` or ``{"chunk": ...}``) from the sink, where the prefill engine's
        process sends it, or from the replica's stream ``gen`` (relayed, a refusal or a failure; ``{"sent": True}``
        once the sink's went). Cancelled while it waits (a disconnect), the prefill call is cancelled too. The sink's
        queue goes on to carry the decode side's chunks: one that comes before the result (the decode engine's
        process failing its stand-by) is left there for the decode stream."""
        replied = asyncio.ensure_future(_only_item(gen))
        early: list[dict] = []
        sent = asyncio.ensure_future(_next_prefilled(queue, early))
        try:
            await asyncio.wait((replied, sent), return_when=asyncio.FIRST_COMPLETED)
            if not sent.done():
                result = replied.result()       # raises if the call failed
                if not result.get("sent"):
                    self.on_chunk("replica")
                    return result
                try:
                    await asyncio.wait_for(asyncio.shield(sent), LAST_CHUNK_S)
                except asyncio.TimeoutError:
                    return {"chunk": error_chunk(502, f"request {request_id}: its prefill's result did not come",
                                                 "server_error")}
            self.on_chunk("sink")
            return {key: value for key, value in sent.result().items() if key in ("ticket", "chunk")}
        finally:
            sent.cancel()
            if early:
                later = [queue.get_nowait() for _ in range(queue.qsize())]
                for item in early + later:
                    queue.put_nowait(item)
            if not replied.done():      # the result came by the sink: the call ends by itself (or was cancelled)
                if asyncio.current_task().cancelling():
                    replied.cancel()
                else:
                    self._keep(replied)

    async def _relayed(self, gen) -> AsyncIterator[dict]:
        """``_cancel_on_exit(gen)``, counted."""
        async for chunk in _cancel_on_exit(gen):
            if chunk["type"] == "tokens":
                self.on_chunk("replica")
            yield chunk

    def _hand(self, host: str, ticket) -> None:
        """The ticket to the decode engine's process that stands by for it (``EngineHost.hand``), not awaited: the
        request's next chunk comes on the decode stream. A host that is gone gives nothing back: the pages go back
        to the prefill side here, and the decode stream ends with the host's failure."""
        async def hand() -> None:
            try:
                await (await self._host(host)).call("hand", ticket.handoff())
            except Exception:
                log.warning("handing %s to %s failed; giving its pages back", ticket.request_id, host, exc_info=True)
                ticket.cancel()

        self._detach(hand())

    async def _host(self, name: str) -> ActorLink:
        link = self._hosts.get(name)
        if link is None or link.broken:       # (a first lookup calls the GCS; a broken link's host is gone)
            actor = await asyncio.to_thread(rank_actor, name)
            link = self._hosts.get(name)
            if link is None or link.broken:
                link = self._hosts[name] = ActorLink(actor)
        return link

    def _warm(self, name: str) -> None:
        """Open the link to a decode engine process seen for the first time while its stand-by's prefill runs, so
        that the hand of its ticket does not wait for it."""
        async def warm() -> None:
            try:
                await (await self._host(name)).connect()
            except Exception:       # the hand will try again, and say why if it fails
                log.debug("opening a link to %s failed", name, exc_info=True)

        if name not in self._hosts:
            self._detach(warm())

    def _detach(self, coroutine) -> None:
        """Run ``coroutine`` apart from the request's task: a cancelled request (a disconnect) must not cancel it."""
        self._keep(asyncio.get_running_loop().create_task(coroutine, context=contextvars.Context()))

    def _keep(self, task: asyncio.Future) -> None:
        """Hold ``task`` until it ends (the event loop keeps only a weak reference)."""
        self._handing.add(task)
        task.add_done_callback(self._handing.discard)


class _StandBy:
    """A request's decode call, opened with its prefill. Its first chunk (``standby``, naming the engine process
    that stands by) is read as soon as it comes; the ticket goes to that process the moment both are here
    (``hand``), not when the router's consumer next asks for a chunk. ``drop`` ends it without a ticket."""

    def __init__(self, router: Router, request_id: str, gen):
        self.router, self.request_id, self.gen = router, request_id, gen
        self.first = asyncio.ensure_future(gen.__anext__())
        self.first.add_done_callback(self._on_stand_by)
        self.ticket = None
        self.handed = self.dropped = False

    def hand(self, ticket) -> None:
        self.ticket = ticket
        if self.first.done():
            self._on_first(self.first)
        else:
            self.first.add_done_callback(self._on_first)

    def _on_stand_by(self, first: asyncio.Future) -> None:
        if not first.cancelled() and first.exception() is None and first.result()["type"] == "standby":
            self.router._warm(first.result()["host"])

    def _on_first(self, first: asyncio.Future) -> None:
        if self.handed or self.dropped or first.cancelled() or first.exception() is not None:
            return
        chunk = first.result()
        if chunk["type"] == "standby":
            self.handed = True
            self.router._hand(chunk["host"], self.ticket)

    async def chunks(self, queue: asyncio.Queue | None = None) -> AsyncIterator[dict]:
        """The decode side's chunks after the ``standby`` one (an error chunk in its place comes first), from the
        request's sink ``queue`` where it has one (``Router._through_sink``)."""
        chunk = await self.router._watching("decode", asyncio.shield(self.first))
        if chunk is None:       # its replica cannot serve: the call is dropped, the request sent again
            self.drop()
            yield error_chunk(503, f"request {self.request_id}: no decode replica can serve it", "unavailable")
            return
        if chunk["type"] != "standby":
            yield chunk
            if queue is not None:
                return
        chunks = self.router._relayed(self.gen) if queue is None else self.router._through_sink(self.request_id,
                                                                                                  self.gen, queue)
        async for chunk in chunks:
            yield chunk

    def drop(self) -> None:
        """No ticket will come (the request ended at the prefill, or its client went away), or the request is
        being abandoned. Handed: cancel the call (it has started: its first chunk came). Else tell the process
        its first chunk names to stop standing by (it frees its reservation and ends the stream), and read the
        stream to its end."""
        if self.dropped:
            return
        self.dropped = True
        if self.handed:
            self.gen.cancel()
            return

        async def drop() -> None:
            try:
                chunk = await self.first
                if chunk["type"] == "standby":
                    await (await self.router._host(chunk["host"])).call("drop", self.request_id)
                async for _ in self.gen:
                    pass
            except Exception:       # the decode replica or its process is gone, and its reservation with it
                log.debug("ending a decode stand-by", exc_info=True)

        self.router._detach(drop())


async def _pump(gen, queue: asyncio.Queue, on_chunk) -> None:
    """A replica's stream into the request's sink queue: its chunks (marked ``relayed``), then ``ended_chunk`` (or
    the exception its call raised)."""
    try:
        async for chunk in gen:
            if chunk["type"] == "tokens":
                on_chunk("replica")
                chunk["relayed"] = True
            queue.put_nowait(chunk)
    except Exception as e:
        queue.put_nowait(e)
        return
    queue.put_nowait(ended_chunk())


async def _next_prefilled(queue: asyncio.Queue, early: list[dict]) -> dict:
    """The prefill's result from a request's sink queue; the items before it go to ``early``."""
    while (item := await queue.get())["type"] != "prefilled":
        early.append(item)
    return item


async def _only_item(gen) -> dict:
    """The one item of a streamed call (``PrefillReplica.prefill_stream``); cancelled or failed while it waits, the
    call is cancelled too (its replica aborts the request and frees its pages)."""
    try:
        return await gen.__anext__()
    except StopAsyncIteration:
        raise RuntimeError("the prefill replica's stream ended without its result") from None
    except BaseException:
        gen.cancel()
        raise


def unavailable(e: BaseException) -> bool:
    """Whether a Serve call's exception says its replica cannot serve (it died, or none is available)."""
    from ray.serve.exceptions import DeploymentUnavailableError

    return isinstance(e, DeploymentUnavailableError) or type(e).__name__ in ("RayActorError", "ActorDiedError",
                                                                            "ActorUnavailableError")


def _last(chunk: dict) -> bool:
    return chunk["type"] == "error" or chunk.get("finished", False)


async def _cancel_on_exit(gen) -> AsyncIterator[dict]:
    """``gen``'s chunks; closed before its last chunk (a disconnect), it cancels the replica's call."""
    finished = False
    try:
        async for chunk in gen:
            finished = _last(chunk)
            yield chunk
        finished = True
    finally:
        if not finished:
            gen.cancel()
