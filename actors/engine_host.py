"""Rank 0's engine in a process of its own (``EngineHost``), and its replica's side of it (``EngineClient``).

A replica's event loop runs Serve's per-request streaming (or the offline driver's); its engine thread needs the
interpreter for the host work of every step. In one process they share one GIL, and on a GPU the engine thread
waited for it for a third of each step at 16 streams (``benchmarks/README.md``). So rank 0's engine runs in an
actor of its own on the replica's node and GPU share. Ray starts, places and supervises it (and answers its
inspection calls); the hot traffic goes over a local socket between the two processes, opened once
(``EngineClient.connect``), where an actor call would cost a millisecond or more per crossing each way:

- commands (add, abort, release, stand by for a prefilled request and take its ticket, fail), host-bound, run in
  the order sent (a stream keeps it: an abort never overtakes the add it aborts); a command that has a result gets
  a reply;
- outputs, replica-bound: one message per engine step with what that step handed over for every request (token
  chunks, finishing results, errors), and the replies. A request that names a sink on this node (``actors.sink``:
  its ingress) has its chunks sent there instead, one message per step per sink, and the replica gets
  ``ended_chunk`` once its last one went.

The socket is in Linux's abstract namespace (nothing on disk to clean up) and takes one connection, which must
first present a random key that only the actor's caller learns: a frame is unpickled only after that.

A decode replica's take-over runs here, next to the engine: the reservation of pages (made while the prefill runs),
the READs (by the ranks' KV managers) and the start of decoding cost the replica's process one command, the ticket
comes straight from the ingress (``hand``, an actor call), and the first output arrives on the request's stream like
any other.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextvars
import dataclasses
import functools
import inspect
import logging
import pickle
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from actors.channel import (ActorLink, ChannelServer, connect_local, frame, frame_size, header_size,
                            listening_socket, pickled, presents_key, read_frame)
from actors.chunks import RequestRefused, ended_chunk, ends, error_chunk, error_from, token_chunk
from actors.cpus import thread_cpus
from actors.engine_loop import EngineStopped, ReservationQueue, hand_over, name_native_thread
from actors.nixl_transfer import TransferError
from actors.sink import SinkAddress
from actors.ticket import Handoff, PrefillOffer, PrefillPages, Ticket, send_holds
from actors.worker import Lifeline, RankWorker, kv_manager
from engine.llm_engine import LLMEngine, RequestOutput
from engine.sequence import Continuation, SamplingParams

log = logging.getLogger(__name__)


class _Forward:
    """A request's stream on the host: what the engine loop hands over goes to the outbox (or to the request's
    sink), tagged; the first output as a chunk with ``first_extra`` in it when that is set (a take-over's transfer
    statistics)."""

    closed = False
    first_extra: dict | None = None

    def __init__(self, request_id: str, outbox: asyncio.Queue, sink: _SinkLink | None = None):
        self.request_id, self.outbox, self.sink = request_id, outbox, sink
        if sink is not None:
            sink.track(request_id)

    issue: Callable[[Any], dict | None] | None = None      # a prefill's: its finishing output to its result

    def prepare(self, item):
        """The item as it goes out: the first output with ``first_extra`` in its chunk."""
        if self.first_extra is not None and isinstance(item, RequestOutput):
            item, self.first_extra = token_chunk(item, **self.first_extra), None
        return item

    def put_nowait(self, item) -> None:
        item = self.prepare(item)
        if self.issue is not None:
            item = self.issue(item)
            if item is None:
                return
        (self.outbox if self.sink is None else self.sink).put_nowait((self.request_id, item))

    @property
    def direct(self) -> bool:
        """Whether the engine loop thread may send this stream's items itself (``_SinkLink.send_step``)."""
        return self.sink is not None and self.issue is None and self.sink.sendable


def _ends_here(item) -> bool:
    """Whether a handed-over item (an output, a chunk, a finishing pair, an exception) ends its request."""
    return item.finished if isinstance(item, RequestOutput) else ends(item)


class _SinkLink:
    """The host's connection to one ``actors.sink.ChunkSink``: the chunks of the requests that name it, one frame
    per batch (a step's). The replica's stream of each such request gets ``ended_chunk`` once its last chunk went.
    A sink this process cannot reach has the replica relay its chunks instead (``relay``, the replica's outbox); a
    sink that goes away (its ingress ended) has its requests aborted (``abort``).

    The engine loop thread sends a step's frame itself (``send_step``), with one non-blocking ``send``, so a step's
    chunks wake no event loop here: a second thread taking the interpreter lock between the engine's calls every
    step slowed a step by up to a third on a GPU host (``benchmarks/host_contention.py``). What the socket does not
    take at once, and what comes before the connection is open, goes through the event loop (``_run``) in order:
    while any of that is pending the loop thread queues behind it."""

    def __init__(self, address: SinkAddress, relay: asyncio.Queue, abort: Callable[[str], None]):
        self.address, self.relay, self.abort = address, relay, abort
        self.requests: set[str] = set()     # requests whose chunks come here, until their last went
        self.relayed = False      # the sink could not be reached: the replica relays
        self.broken = False
        self.frames_sent_by_loop_thread = 0      # (inspection)
        self._queue: asyncio.Queue = asyncio.Queue()     # pairs lists and bytes, in order, for ``_run``
        self._sock: socket.socket | None = None     # open, key sent: the loop thread may send on it
        self._pending = 0         # items in ``_queue`` (or on their way to it) not yet sent
        self._lock = threading.Lock()        # ``_sock`` and ``_pending``, between the two threads
        self._loop = asyncio.get_running_loop()
        self._task = self._loop.create_task(self._run(), context=contextvars.Context())

    @property
    def sendable(self) -> bool:
        return not self.relayed and not self.broken

    def track(self, request_id: str) -> None:
        if not self.relayed:
            self.requests.add(request_id)

    # --- the event loop's side ------------------------------------------------------------------------------
    def put_nowait(self, pair: tuple[str, Any]) -> None:
        with self._lock:
            self._pending += 1
        self._enqueue([pair])

    def _enqueue(self, item: list | bytes) -> None:
        if self.broken:       # its requests were aborted: nobody reads them
            return
        if self.relayed:
            for pair in item:       # (bytes only come once the connection is open: never here)
                self.relay.put_nowait(pair)
            with self._lock:
                self._pending -= 1
            return
        self._queue.put_nowait(item)

    def _ended(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            if request_id in self.requests:
                self.requests.discard(request_id)
                self.relay.put_nowait((request_id, ended_chunk()))

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            sock = connect_local(self.address.address)
            sock.setblocking(False)
            await loop.sock_sendall(sock, frame(self.address.key))
        except OSError as e:
            log.warning("cannot reach chunk sink %s (%s): the replica relays its requests' chunks", self.address.name,
                        e)
            self.relayed = True
            self.requests.clear()
            while not self._queue.empty():
                self._enqueue(self._queue.get_nowait())
            return
        with self._lock:
            self._sock = sock
        sending = asyncio.current_task()
        watch = asyncio.ensure_future(loop.sock_recv(sock, 1))     # the sink sends nothing: ends when it goes away
        watch.add_done_callback(lambda _: sending.cancel())
        try:
            while True:
                items = [await self._queue.get()]
                while not self._queue.empty():
                    items.append(self._queue.get_nowait())
                # In order: the rest of a frame the loop thread began (bytes), and pairs (consecutive ones as one
                # frame).
                pairs: list[tuple[str, Any]] = []
                for item in items + [b""]:
                    if isinstance(item, bytes):
                        if pairs:
                            await loop.sock_sendall(sock, pickled(("out", [(r, _wire(i)) for r, i in pairs])))
                            self._ended([r for r, i in pairs if _ends_here(i)])
                            pairs = []
                        if item:
                            await loop.sock_sendall(sock, item)
                    else:
                        pairs += item
                with self._lock:
                    self._pending -= len(items)
        except (asyncio.CancelledError, ConnectionError, OSError):
            pass
        finally:
            watch.cancel()
            with self._lock:      # the loop thread never sends on a closed (maybe reused) descriptor
                self._sock, self.broken = None, True
            sock.close()
            if self.requests:
                log.warning("chunk sink %s went away: aborting its %d request(s)", self.address.name,
                            len(self.requests))
            for request_id in list(self.requests):
                self.abort(request_id)
                self.relay.put_nowait((request_id, error_chunk(499, "the ingress streaming this request went away",
                                                               "aborted")))
            self.requests.clear()

    # --- the engine loop thread's side ----------------------------------------------------------------------
    def send_step(self, pairs: list[tuple[str, Any]]) -> None:
        """A step's ``(request_id, item)`` pairs for this sink, from the loop thread: sent now when nothing is
        pending, else queued behind what is."""
        data = pickled(("out", [(request_id, _wire(item)) for request_id, item in pairs]))
        sent = None
        with self._lock:
            if self._sock is not None and not self._pending:
                try:
                    sent = self._sock.send(data)
                except BlockingIOError:
                    sent = 0
                except OSError:       # the sink went away: ``_run`` ends the link and aborts its requests
                    return
                if sent < len(data):
                    self._pending += 1
            else:
                self._pending += 1
        if sent is None:
            self._loop.call_soon_threadsafe(self._enqueue, pairs)
            return
        self.frames_sent_by_loop_thread += 1
        if sent < len(data):
            self._loop.call_soon_threadsafe(self._enqueue, data[sent:])
        ended = [request_id for request_id, item in pairs if _ends_here(item)]
        if ended:
            self._loop.call_soon_threadsafe(self._ended, ended)


@dataclasses.dataclass
class _TakeOver:
    """A decode take-over in progress: its stream, its parameters, its reservation's waiter, the future its
    ``Handoff`` arrives in (None: it will not, the replica aborted it or it stopped waiting), its task (held here:
    the event loop keeps only a weak reference), and whether the replica aborted it."""

    stream: _Forward
    params: SamplingParams
    waiter: concurrent.futures.Future
    handed: asyncio.Future
    task: asyncio.Task | None = None
    cancelled: bool = False


def _wire(item) -> Any:
    """What a handed-over item becomes on the way to the replica: a chunk, not the whole RequestOutput (its
    token lists and text grow with the request); an exception becomes its error chunk; a chunk goes as it is."""
    if isinstance(item, dict):
        return item
    if isinstance(item, RequestOutput):
        return token_chunk(item)
    if isinstance(item, tuple):
        return token_chunk(item[0]), item[1]
    return error_from(item)


class EngineHost(Lifeline, RankWorker):
    """Rank 0 as an actor: builds the engine, steps it in its engine loop thread, runs the commands its replica
    sends over the socket in order and sends the steps' outputs back on it."""

    def __init__(self, config, kv_manager=None, *, kv_managers: Sequence = (), kv_manager_names: Sequence[str] = (),
                 **kwargs):
        self._build_error: BaseException | None = None
        try:
            super().__init__(config, kv_manager, tp_rank=0, **kwargs)
        except Exception as e:      # told by ``ready`` as itself (a bad config is a ValueError to the replica)
            self._build_error = e
            return
        self.kv_managers = list(kv_managers)      # every rank's, in rank order: they READ a take-over's pages
        self._readers = [ActorLink(kvm) for kvm in self.kv_managers]     # ... called over their channels
        self.kv_manager_names = list(kv_manager_names)      # their names: the readers the lease checks name
        self._peers: dict[str, ActorLink] = {}    # prefill KV managers by name (a first lookup is a call to Ray's GCS)
        self._plans: dict[str, list[list[int]]] = {}    # per prefill replica (its rank 0's agent): _plan's
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._sinks: dict[str, _SinkLink] = {}     # by sink name: where requests that name one send their chunks
        self._tickets: dict[str, Ticket] = {}      # prefills issued here, until their pages are released
        self._reservations = ReservationQueue(self.loop)
        self.loop.direct = self._direct
        self._taking: dict[str, _TakeOver] = {}
        self._stand_bys = 0      # take-overs ever begun (inspection)
        self._key = secrets.token_bytes(32)
        self._listener, self._address = listening_socket("engine")
        self._server: asyncio.AbstractServer | None = None
        self._connected = False
        self._tasks: set[asyncio.Task] = set()     # replies in flight (the event loop keeps weak references)
        # The ingress hands tickets over (and drops stand-bys) over a channel of its own, any number of callers.
        self._channel = ChannelServer(self, ("hand", "drop"), "engine-hand")

    def ready(self) -> None:
        if self._build_error is not None:
            raise self._build_error

    async def describe(self) -> dict:
        """What the replica needs to connect: the engine's page size, this process's node, the socket's address and
        the key a connection must present (the caller of this actor is the only one to learn it)."""
        import ray

        if self._server is None:
            self._server = await asyncio.start_unix_server(self._serve, sock=self._listener)
        return {"page_size": self.engine.kv.page_size, "node_id": ray.get_runtime_context().get_node_id(),
                "address": self._address, "key": self._key}

    async def thread_cpus(self) -> list[list[int]]:
        """(Inspection) ``actors.cpus.thread_cpus`` of this process."""
        return thread_cpus()

    async def channel_info(self) -> dict:
        """Where the ingress's ``hand`` and ``drop`` calls go when it runs on this node (``actors.channel``)."""
        return await self._channel.info()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The replica's connection: its key, then its commands until it closes the connection. Any other
        connection (a second one, a wrong key) is closed unread."""
        if not await presents_key(reader, self._key) or self._connected:
            writer.close()
            return
        self._connected = True
        self._server.close()          # no other connection from now on
        sender = asyncio.get_running_loop().create_task(self._send_outputs(writer))
        try:
            while True:
                call, name, args = pickle.loads(await read_frame(reader))
                self._run(writer, call, name, args)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:      # the replica went away (its process ended): nothing will read this engine's outputs again
            sender.cancel()
            writer.close()
            self.loop.fail(EngineStopped("its replica closed the connection"))

    def _run(self, writer: asyncio.StreamWriter, call: int | None, name: str, args: tuple) -> None:
        """Hand command ``name`` to the engine loop now (so in the order sent); reply to a numbered ``call`` with
        its result once it has one."""
        try:
            pending = getattr(self, f"_do_{name}")(*args)
        except Exception as e:
            if call is None:      # nobody waits for its result: a bug, said where it can be seen
                log.exception("command %s failed", name)
                return
            pending = e
        if call is None:
            if inspect.isawaitable(pending):
                self._keep(asyncio.ensure_future(pending))
            return

        async def reply() -> None:
            try:
                if isinstance(pending, Exception):
                    raise pending
                value = await pending if inspect.isawaitable(pending) else pending
                message = ("reply", call, True, value)
            except Exception as e:
                message = ("reply", call, False, e)
            try:
                data = pickled(message)
            except Exception as e:      # a result or an exception that does not pickle: told as text
                data = pickled(("reply", call, False, RuntimeError(f"{type(e).__name__}: {e}")))
            writer.write(data)

        self._keep(asyncio.get_running_loop().create_task(reply()))

    def _keep(self, task: asyncio.Task) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send_outputs(self, writer: asyncio.StreamWriter) -> None:
        """Per batch of what the engine loop handed over (one engine step's, or more if the socket is slower), the
        ``(request_id, item)`` pairs as one message, an item being a token chunk, a finishing ``(chunk, on_finish
        result)`` or an error chunk."""
        while True:
            items = [await self._outbox.get()]
            while not self._outbox.empty():
                items.append(self._outbox.get_nowait())
            writer.write(pickled(("out", [(request_id, _wire(item)) for request_id, item in items])))
            await writer.drain()

    def _open(self, request_id: str, on_finish=None, sink: SinkAddress | None = None) -> _Forward:
        return self.loop.open_stream(request_id, on_finish,
                                     queue=_Forward(request_id, self._outbox, sink and self._sink(sink)))

    @staticmethod
    def _direct(prepared: list[tuple[str, Any]], streams: dict) -> list[tuple[str, Any]]:
        """``EngineLoop.direct``, on the loop thread: the step's items of requests streaming to a sink that can take
        them go as one frame per sink (``_SinkLink.send_step``); the rest (no sink, a prefill's result, an error)
        are returned for the event loop. A closed stream's items are dropped (its request was aborted)."""
        batches: dict[_SinkLink, list[tuple[str, Any]]] = {}
        rest = []
        for request_id, item in prepared:
            target = streams.get(request_id)
            if target is None:
                continue
            forward = target[1]
            if not isinstance(forward, _Forward) or not forward.direct or isinstance(item, BaseException):
                rest.append((request_id, item))
                continue
            if _ends_here(item):
                streams.pop(request_id, None)
            if not forward.closed:
                batches.setdefault(forward.sink, []).append((request_id, forward.prepare(item)))
        for link, pairs in batches.items():
            link.send_step(pairs)
        return rest

    def _sink(self, address: SinkAddress) -> _SinkLink:
        """The link to the sink at ``address``, opened on its first request (again if it broke)."""
        link = self._sinks.get(address.name)
        if link is None or link.broken:
            for gone in [name for name, old in self._sinks.items() if old.broken]:     # ingresses that ended
                del self._sinks[gone]
            link = self._sinks[address.name] = _SinkLink(address, self._outbox, self._do_abort)
        return link

    # --- commands: each hands its work to the engine loop before returning (an awaitable for its result) -------
    def _do_start(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, hold_pages: bool,
                  on_finish: Callable[[LLMEngine, RequestOutput], Any] | None, sink: SinkAddress | None = None,
                  offer: PrefillOffer | None = None, ticket_params: SamplingParams | None = None,
                  continuation: Continuation | None = None) -> None:
        """Open the request's stream and add it on the engine loop thread. Nothing is sent back for an added request
        (no reply to wait for, no wake-up of this event loop): a refusal (``RequestRefused``, a 400) or an engine
        that stopped comes on the request's stream, as its one item."""
        stream = self._open(request_id, on_finish, sink)
        if offer is not None:
            stream.issue = functools.partial(self._issue, request_id, list(prompt_token_ids), ticket_params, offer,
                                             time.perf_counter())

        def add(e: LLMEngine) -> None:
            try:
                e.add_request(prompt_token_ids, params, request_id=request_id, hold_pages=hold_pages,
                              continuation=continuation)
            except ValueError as refused:
                self.loop.deliver([(request_id, RequestRefused(str(refused)))])
            except Exception as failed:      # a bug, told to the request (a 500) and logged
                log.exception("adding request %s failed", request_id)
                self.loop.deliver([(request_id, failed)])

        added = self.loop.submit(add)
        if added.done() and isinstance(added.exception(), EngineStopped):     # the loop had stopped already
            self.loop.deliver([(request_id, added.exception())])

    def _forget(self, request_id: str) -> None:
        """The request's stream is closed: no sink waits for its chunks any more."""
        for link in self._sinks.values():
            link.requests.discard(request_id)

    def _do_abort(self, request_id: str) -> None:
        self._forget(request_id)
        ticket = self._tickets.pop(request_id, None)
        if ticket is not None:      # its pages are held under leases: ending those frees them (``_do_release``)
            self._keep(asyncio.ensure_future(asyncio.to_thread(ticket.cancel)))
            return
        self.loop.abort(request_id)       # a request whose READ runs keeps its pages until the READ ends
        taking = self._taking.get(request_id)
        if taking is not None:            # still waiting for pages: stop waiting; granted: freed, never READ
            taking.cancelled = True
            self.loop.submit(lambda _: self._reservations.forget(request_id))
            if not taking.handed.done():        # standing by for its ticket: stop
                taking.handed.set_result(None)

    def _do_release(self, request_id: str) -> None:
        self._tickets.pop(request_id, None)
        self.loop.submit(lambda e: e.release(request_id))

    def _issue(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, offer: PrefillOffer,
               start: float, item) -> dict | None:
        """A prefill's output as its result (``{"type": "prefilled"}`` with its ``ticket``, or the ``chunk`` that
        ends the request here); None for a partial prefill's output (the prompt is not computed yet). A ticket's
        holds go to the KV managers right after it (a READ that overtakes its hold waits for it)."""
        if isinstance(item, RequestOutput):
            return None
        if not isinstance(item, tuple):
            return {"type": "prefilled", "chunk": _wire(item)}      # an error: the engine loop freed the pages
        chunk, handed = _wire(item)
        if handed is None:        # the request ends here; its one output carries all of it
            self._do_release(request_id)
            return {"type": "prefilled", "chunk": chunk}
        ticket = offer.issue(request_id, prompt_token_ids, params, chunk, handed, time.perf_counter() - start)
        self._tickets[request_id] = ticket
        asyncio.get_running_loop().call_soon(send_holds, self._readers, ticket, context=contextvars.Context())
        return {"type": "prefilled", "ticket": ticket}

    def _do_stand_by(self, request_id: str, params: SamplingParams, attempt: Callable[[LLMEngine], Any],
                     draft_context: bool, ticket_timeout_s: float, reserve_timeout_s: float,
                     read_timeout_s: float, sink: SinkAddress | None = None) -> None:
        """Decode side, sent as the prefill starts: reserve pages for the request's prompt (``attempt``:
        ``actors.replica._reserve``) and stand by for its ticket (``hand``, at most ``ticket_timeout_s``); then have
        every rank's KV manager READ its KV into them, and start decoding it. Its stream gets the first output,
        carrying the transfer's statistics, or an error chunk. An abort stops it wherever it is, and its pages are
        freed only once no READ can write into them."""
        if request_id in self._taking:
            raise ValueError(f"request id {request_id!r} already awaits a transfer here")
        self._stand_bys += 1
        taking = self._taking[request_id] = _TakeOver(self._open(request_id, sink=sink), params,
                                                      self._reservations.begin(request_id, attempt),
                                                      asyncio.get_running_loop().create_future())
        taking.task = asyncio.get_running_loop().create_task(
            self._take_over(request_id, taking, draft_context, ticket_timeout_s, reserve_timeout_s, read_timeout_s),
            context=contextvars.Context())

    def _do_hand(self, handoff: Handoff) -> bool:
        """The ticket of a take-over standing by here: True if it takes it; False if none does (aborted, timed out,
        never stood by), and then the prefill pages are given back."""
        taking = self._taking.get(handoff.pages.request_id)
        if taking is None or taking.handed.done():
            self._keep(asyncio.ensure_future(asyncio.to_thread(handoff.pages.cancel)))
            return False
        taking.handed.set_result(handoff)
        return True

    async def hand(self, handoff: Handoff) -> bool:
        """``_do_hand`` as an actor call: the ingress hands the ticket straight to this process, not through the
        decode replica (whose stream told it this actor's name)."""
        return self._do_hand(handoff)

    async def drop(self, request_id: str) -> None:
        """The take-over standing by for ``request_id`` will get no ticket (its request ended at the prefill, or its
        client went away): it frees its reservation and ends its stream."""
        taking = self._taking.get(request_id)
        if taking is not None and not taking.handed.done():
            taking.handed.set_result(None)

    async def _take_over(self, request_id: str, taking: _TakeOver, draft_context: bool, ticket_timeout_s: float,
                         reserve_timeout_s: float, read_timeout_s: float) -> None:
        """The take-over's first output carries its transfer's statistics, with the seconds of its phases here,
        counted from its ticket's arrival: ``reserve_s`` (waiting for pages, if they were not reserved by then),
        ``settle_s`` (waiting for the device before posting the READs, with the lease checks on their way),
        ``read_s`` (the rest of the lease checks and READs, to the last one's end) and ``start_s`` (the engine
        thread starting the request's decoding)."""
        handoff = None
        try:
            refused = None
            try:
                handoff = await asyncio.wait_for(asyncio.shield(taking.handed), ticket_timeout_s)
            except asyncio.TimeoutError:
                refused = error_chunk(504, f"the prefill's result did not reach the decode replica within "
                                           f"{ticket_timeout_s:g} s", "timeout")
            began = time.perf_counter()
            plan = None
            if handoff is not None and not taking.cancelled:
                try:
                    self.engine.check_first_token(taking.params, handoff.first_token, handoff.first_logprob)
                    plan = await self._plan(handoff)
                except Exception as e:      # a bad first token, a peer that does not match: refused, nothing READ
                    refused = refusal(e)
            reserved = None
            if plan is not None and not taking.cancelled:
                try:
                    reserved = await self._reservations.wait(request_id, taking.waiter, reserve_timeout_s)
                except Exception as e:
                    refused = refusal(e)
                if reserved is None and refused is None:
                    refused = error_chunk(503, "no decode KV pages free", "overloaded")
            else:       # not going ahead: take back the reservation, or learn it was granted
                reserved = await self._reservations.withdraw(request_id, taking.waiter)
            if plan is None or refused is not None or taking.cancelled:
                if handoff is not None:     # nothing READs the prefill pages: give them back
                    await asyncio.to_thread(handoff.pages.cancel)
                if reserved is not None:       # granted, and no READ touches these pages: free them
                    self.loop.submit(lambda e: e.finish_transfer(request_id, False))
                self.loop.deliver([(request_id, refused or error_chunk(499, "the request ended before its decode",
                                                                       "aborted"))])
                return
            pages = handoff.pages
            tables, reused, settled = reserved
            reserved_at = time.perf_counter()
            stats, error = await self._read(pages, tables, reused, plan, draft_context, read_timeout_s, settled)
            read_at = time.perf_counter()
            stats.update(reserve_s=reserved_at - began, read_s=read_at - reserved_at - stats.get("settle_s", 0.0))
            taking.stream.first_extra = {"transfer": stats}

            def finish(e: LLMEngine) -> None:
                try:
                    out = e.finish_transfer(request_id, error is None, draft_context=draft_context,
                                            first_token=handoff.first_token, first_logprob=handoff.first_logprob,
                                            sampler_state=handoff.sampler_state)
                except ValueError as bad:      # the pages are freed; the request's stream is told
                    out = bad
                stats["start_s"] = time.perf_counter() - read_at
                # Delivered from the engine thread, so it precedes this request's next step's output.
                self.loop.deliver([(request_id, out if error is None else _transfer_failure(pages, error))])

            self.loop.submit(finish)
        except Exception as e:       # a bug here must not leave the request's stream open
            log.exception("take-over of %s failed", request_id)
            self.loop.deliver([(request_id, e)])
        finally:
            self._taking.pop(request_id, None)
            if not taking.handed.done():
                taking.handed.set_result(None)

    async def _plan(self, handoff: Handoff) -> list[list[int]]:
        """Per decode rank, the prefill ranks it READs from (every decode rank registers every prefill rank once per
        prefill replica). PeerMismatchError (page size, layer counts, dtypes, a TP split that cannot be mapped)
        names both values."""
        agents = handoff.pages.peer_agents
        plan = self._plans.get(agents[0])
        if plan is None:
            try:
                peers = await asyncio.to_thread(lambda: [kv_manager(agent) for agent in agents])
            except ValueError as e:      # a prefill KV manager that is gone: nothing to READ, nothing posted
                raise TransferError(f"a prefill KV manager is gone: {e}") from e
            plan = await asyncio.gather(
                *(kvm.register_peers.remote(handoff.rank_infos, peers) for kvm in self.kv_managers))
            # The hand-off's calls go over channels where the actors share this node: opened now, once per peer.
            for gone in [agent for agent, link in self._peers.items() if link.broken]:     # replicas replaced
                del self._peers[gone]
                self._plans.pop(gone, None)
            for agent, peer in zip(agents, peers):
                self._peers.setdefault(agent, ActorLink(peer))
            await asyncio.gather(*(link.connect() for link in [*self._readers, *(self._peers[a] for a in agents)]))
            self._plans[agents[0]] = plan
        return plan

    async def _read(self, pages: PrefillPages, tables: list[list[int]], reused: int, plan: list[list[int]],
                    draft_context: bool, timeout_s: float, settled=None) -> tuple[dict, BaseException | None]:
        """Every rank READs from the prefill ranks in its ``plan`` at once (equal TP: rank r from rank r) the
        pages after the ``reused`` leading ones this side already holds, once ``settled`` (``_reserve``'s) says
        this engine's device can no longer write into them; returns once every READ has ended: the transfer's
        statistics, or the first error."""
        readers = collections.Counter(source for sources in plan for source in sources)
        unread = [source for source in range(len(pages.leases)) if not readers[source]]
        if unread:      # their heads come from other prefill ranks holding them too
            await asyncio.to_thread(pages.cancel, unread)
        pairs = [(rank, source) for rank, sources in enumerate(plan) for source in sources]
        # Each rank's KV manager posts its READ at once, and the lease checks go to the prefill KV managers from
        # here alongside them (not after a hop to the reader): the bytes are kept only if every check grants its
        # lease (``KVManagerActor.read`` says why that is safe). Both end before anything is decided or freed.
        start, answered = time.perf_counter(), []
        checks = [asyncio.ensure_future(self._check_lease(pages, source, self.kv_manager_names[rank], readers[source],
                                                          timeout_s, answered)) for rank, source in pairs]
        unsettled = None
        try:
            if settled is not None and not settled.query():
                # A step launched ahead may still write into pages freed on the host since: wait for the device
                # here, not on the engine thread, which goes on stepping (the lease checks are on their way).
                await asyncio.to_thread(settled.synchronize)
        except Exception as e:       # the device failed: nothing is READ
            unsettled = TransferError(f"waiting for the device before the READ failed: {e}")
        posted = time.perf_counter()
        reads = [] if unsettled is not None else [
            self._readers[rank].call("read", None, pages.peer_agents[source], [t[reused:] for t in pages.tables],
                                     [t[reused:] for t in tables], draft_context, timeout_s, readers[source])
            for rank, source in pairs]
        outcomes = await asyncio.gather(*checks, *reads, return_exceptions=True)
        granted, reads = outcomes[:len(pairs)], outcomes[len(pairs):]
        for (rank, source), check in zip(pairs, granted):
            if check is True:
                self._peers[pages.peer_agents[source]].send("end_read", pages.leases[source],
                                                            self.kv_manager_names[rank])
        # A refused lease first: a READ of freed pages may fail too, and the refusal is why.
        error = next((c for c in granted if isinstance(c, BaseException)), None)
        if error is None and False in granted:
            source = pairs[granted.index(False)][1]
            error = TransferError(f"the prefill hold {pages.leases[source]} at {pages.peer_agents[source]} expired "
                                  "or was cancelled before its READ")
        if error is None:
            error = unsettled or next((r for r in reads if isinstance(r, BaseException)), None)
        if error is not None:
            if len(pairs) > 1:
                # A lease whose other readers ended while one failed before its READ began: give it back now.
                await asyncio.to_thread(pages.cancel)
            return {}, error
        return {"bytes": sum(r["bytes"] for r in reads), "seconds": max(r["seconds"] for r in reads),
                "lease_seconds": max(answered) - start, "settle_s": posted - start,
                "descriptors": sum(r["descriptors"] for r in reads), "tables": tables, "reused_pages": reused,
                "transport": "+".join(sorted({r["transport"] for r in reads}))}, None

    async def _check_lease(self, pages: PrefillPages, source: int, reader: str, num_readers: int, timeout_s: float,
                           answered: list[float]) -> bool:
        """``begin_read`` of prefill rank ``source``'s lease for decode rank ``reader``: True if granted."""
        granted = await self._peers[pages.peer_agents[source]].call("begin_read", pages.leases[source], timeout_s,
                                                                    reader, num_readers)
        answered.append(time.perf_counter())
        return granted

    def _do_fail(self, message: str) -> None:
        self.loop.fail(EngineStopped(message))

    # --- inspection (tests, benchmarks, health) -------------------------------------------------------------------
    def problem(self) -> str | None:
        return None if self.loop.alive else "the engine loop has stopped"

    async def pages_in_use(self) -> int:
        return await self.loop.call(lambda e: e.kv.pages_in_use())

    async def page_digest(self, tables: list[list[int]], owners: Sequence[str] = ("target", "draft")) -> str:
        return await self.loop.call(lambda _: RankWorker.page_digest(self, tables, owners))

    async def gauges(self) -> dict:
        """Batch sizes, pages in use per pool (with its owners) and the engine loop's time (``LoopStats``), the
        time it waited for the device's results, and preemptions, for the replica's metrics report."""
        def read(e: LLMEngine) -> dict:
            return {**engine_gauges(e), "loop": {**self.loop.stats.snapshot(), "device_wait_s": e.device_wait_s,
                                                 "preemptions": e.scheduler.num_preemptions}}

        gauges = await self.loop.call(read)
        gauges["awaiting_transfer"] = len(self._taking)
        gauges["stand_bys"] = self._stand_bys
        return gauges

    async def kv_head_counts(self) -> list[set[int]]:
        """Per pool, the kv-head counts of its layers on this rank."""
        return await self.loop.call(lambda e: [{s.num_kv_heads for s in pool.specs} for pool in e.kv.pools])


def refusal(e: BaseException) -> dict:
    """The error chunk for a decode take-over refused (bad input, a peer that does not match: 400) or that could not
    run (503, 500)."""
    if isinstance(e, EngineStopped):
        return error_from(e)
    status, kind = (400, "invalid_request_error") if type(e) is ValueError else (500, "server_error")
    return error_chunk(status, f"decode replica refused the request: {e}", kind)


def _transfer_failure(pages: PrefillPages, error: BaseException) -> TransferError:
    cause = error.args[0] if isinstance(error, TransferError) and error.args else f"{type(error).__name__}: {error}"
    return TransferError(f"request {pages.request_id}: KV transfer from {pages.peer_agents[0]} failed: {cause}")


def engine_gauges(engine: LLMEngine) -> dict:
    kv = engine.kv
    pools = []
    for i, pool in enumerate(kv.pools):
        owners = "+".join(o for o in ("target", "draft") if any(s.owner.value == o for s in pool.specs))
        pools.append({"pool": i, "owner": owners, "in_use": kv.pages_in_use(i), "total": pool.num_pages})
    return {"running": len(engine.scheduler.running), "waiting": len(engine.scheduler.waiting), "pools": pools}


def _settle(reply: concurrent.futures.Future, ok: bool, value) -> None:
    """A command's result into its reply, unless its caller gave up waiting: a cancelled call (a client that left
    while its request waited) cancels the future, which then takes no result."""
    if reply.set_running_or_notify_cancel():
        reply.set_result(value) if ok else reply.set_exception(value)


class EngineClient:
    """The replica's side of its ``EngineHost``: per-request streams fed by the host's outputs (a thread receives
    each message and hands it to the streams' event loops, one wake-up each), and the commands, sent in order over
    the socket. If the host dies every open stream ends with ``EngineStopped`` and later commands fail with it."""

    def __init__(self, host):
        self.host = host
        self.page_size: int = 0
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._failure: EngineStopped | None = None
        self._socket: socket.socket | None = None
        self._sending = threading.Lock()       # one frame at a time, in the order the commands were made
        self._calls = 0
        self._replies: dict[int, concurrent.futures.Future] = {}
        self._pump = threading.Thread(target=self._receive, name="engine-outputs", daemon=True)

    def connect(self) -> None:
        """Connect to the host (it must be built: its constructor has returned) and start receiving."""
        import ray

        info = ray.get(self.host.describe.remote())
        here = ray.get_runtime_context().get_node_id()
        if info["node_id"] != here:
            raise RuntimeError(f"the engine process runs on node {info['node_id']}, its replica on {here}: they "
                               "talk over a local socket and must share a node (the rank's scheduling places them so)")
        self.page_size = info["page_size"]
        self.node_id: str = here
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._socket.connect(info["address"])
        except OSError as e:
            raise RuntimeError(f"cannot reach this replica's engine process over its local socket ({e}): the two "
                               "processes must share a network namespace (not separate containers)") from e
        self._socket.sendall(frame(info["key"]))
        self._pump.start()

    # --- streams ----------------------------------------------------------------------------------------------
    def open_stream(self, request_id: str) -> asyncio.Queue:
        """The request's queue: token chunks, then the last (``finished``, or an error chunk, or the pair
        ``(chunk, result)`` of an ``on_finish``). ValueError while a request with this id streams here."""
        from actors.engine_loop import _Stream

        if request_id in self._streams:      # a second stream would take the first one's outputs, and end it
            raise ValueError(f"request id {request_id!r} is already in use on this replica")
        q = _Stream()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        if self._failure is not None:
            q.put_nowait(error_from(self._failure))
        return q

    def close_stream(self, request_id: str) -> None:
        """Stop the stream (on the event loop that opened it): nothing arrives after this returns."""
        target = self._streams.pop(request_id, None)
        if target is not None:
            target[1].closed = True

    def _receive(self) -> None:
        name_native_thread("engine-outputs")
        gone = EngineStopped("this replica's engine process is gone (its connection closed); retry the request")
        try:
            with self._socket.makefile("rb") as incoming:
                while len(header := incoming.read(header_size())) == header_size():
                    message = pickle.loads(incoming.read(frame_size(header)))
                    if message[0] == "out":
                        hand_over(self._streams, message[1], ends)
                    else:
                        _, call, ok, value = message
                        reply = self._replies.pop(call, None)
                        if reply is not None:      # else the streams were ended (``fail``) while it ran
                            _settle(reply, ok, value)
        except Exception as e:        # the connection broke, or a message did not unpickle
            if not isinstance(e, OSError):
                log.exception("the engine process's outputs could not be read")
                gone = EngineStopped(f"this replica's engine process is gone ({type(e).__name__}); retry the request")
        self._end_streams(gone)

    def _end_streams(self, error: EngineStopped) -> None:
        if self._failure is None:
            self._failure = error
        with self._sending:
            replies, self._replies = self._replies, {}
        for reply in replies.values():
            _settle(reply, False, self._failure)
        hand_over(self._streams, [(r, error_from(error)) for r in list(self._streams)], ends)

    # --- commands ---------------------------------------------------------------------------------------------
    def _command(self, name: str, *args, reply: bool = False) -> concurrent.futures.Future | None:
        """Send command ``name``; with ``reply``, the future of its result. An argument that does not pickle raises
        here and sends nothing; a host that is gone raises EngineStopped."""
        with self._sending:
            if self._failure is not None:
                raise EngineStopped(str(self._failure))
            call = None
            if reply:
                call, self._calls = self._calls, self._calls + 1
            data = pickled((call, name, args))
            if reply:
                future = self._replies[call] = concurrent.futures.Future()
            try:
                self._socket.sendall(data)     # blocks only while a large frame waits for the host to read
            except OSError as e:     # the host is gone; the receiving thread ends the streams
                self._replies.pop(call, None)
                raise EngineStopped(f"this replica's engine process is gone ({type(e).__name__}); retry the request")
        return future if reply else None

    async def start(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                    hold_pages: bool = False, on_finish: Callable[[LLMEngine, RequestOutput], Any] | None = None,
                    sink: SinkAddress | None = None, offer: PrefillOffer | None = None,
                    ticket_params: SamplingParams | None = None, continuation: Continuation | None = None
                    ) -> dict | None:
        """Add the request (its stream must be open): None once the command went, or the error chunk of an engine
        process that is gone (503). The host sends nothing back for an added request; a refusal (bad input, 400)
        or a failure arrives on the stream as its one item. ``on_finish`` runs on the engine thread as the
        finished output is handed over (``EngineLoop.open_stream``): module-level, it travels by reference. With
        ``sink`` (on this node) the host sends the request's chunks there, and its stream here gets only
        ``ended_chunk`` or an error. With ``offer`` (a prefill, ``on_finish`` being ``actors.ticket.handover``)
        the host issues the request's ticket (for ``ticket_params``, the request's own) and sends its result as
        one ``{"type": "prefilled"}`` item. With ``continuation`` the request goes on from output it gave out on
        an engine that was lost (``LLMEngine.add_request``)."""
        try:
            self._command("start", request_id, list(prompt_token_ids), params, hold_pages, on_finish, sink, offer,
                          ticket_params, continuation)
        except EngineStopped as e:
            return error_from(e)
        return None

    def abort(self, request_id: str) -> None:
        """Abort and free the request's pages; safe in a cancelled coroutine's ``finally`` (nothing to await)."""
        self.close_stream(request_id)
        try:
            self._command("abort", request_id)
        except EngineStopped:     # nothing to abort: the engine and its pages are gone
            pass

    def release(self, request_id: str) -> None:
        """Free a finished request's held pages."""
        try:
            self._command("release", request_id)
        except EngineStopped:
            pass

    async def stand_by(self, request_id: str, params: SamplingParams, attempt: Callable[[LLMEngine], Any],
                       draft_context: bool, ticket_timeout_s: float, reserve_timeout_s: float,
                       read_timeout_s: float, sink: SinkAddress | None = None) -> dict | None:
        """Have the host reserve pages for a request whose prefill runs elsewhere and stand by for its ticket (then
        READ its KV and start decoding it: ``EngineHost._do_stand_by``); its stream must be open. None once the
        host stands by (a ``hand`` may come from now on), or the error chunk that refused it. Its outcome arrives
        on the stream, and ``abort`` stops it."""
        try:
            await asyncio.wrap_future(self._command("stand_by", request_id, params, attempt, draft_context,
                                                    ticket_timeout_s, reserve_timeout_s, read_timeout_s, sink,
                                                    reply=True))
        except EngineStopped as e:
            return error_from(e)
        except ValueError as e:
            return error_chunk(400, str(e), "invalid_request_error")
        return None

    def hand(self, handoff: Handoff) -> None:
        """A standing-by take-over's ticket, over the socket (the offline driver; the service's ingress calls the
        host's ``hand`` directly). Were none standing by, the host gives the prefill pages back."""
        try:
            self._command("hand", handoff)
        except EngineStopped:       # nothing stands by any more: the pages go back to the prefill side
            handoff.pages.cancel()

    def fail(self, error: EngineStopped) -> None:
        """Stop serving for good: open streams end with ``error`` now, later commands are refused, and the host
        stops computing (``EngineLoop.fail``)."""
        if self._failure is not None:
            return
        try:
            self._command("fail", str(error))
        except EngineStopped:      # the host is gone already
            pass
        self._end_streams(error)

    @property
    def failed(self) -> bool:
        return self._failure is not None

    @property
    def alive(self) -> bool:
        return self._failure is None and self._pump.is_alive()
