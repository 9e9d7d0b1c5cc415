"""Rank 0's engine in a process of its own (``EngineHost``), and its replica's side of it (``EngineClient``).

A replica's event loop runs Serve's per-request streaming (or the offline driver's); its engine thread needs the
interpreter for the host work of every step. In one process they share one GIL, and on a GPU the engine thread
waited for it for a third of each step at 16 streams (``benchmarks/README.md``). So rank 0's engine runs in an
actor of its own on the replica's node and GPU share, and the two talk over two channels:

- outputs: one streaming actor call, open for the replica's life, that yields once per engine step what that
  step handed over for every request (token chunks, finishing results, errors) as one message;
- commands (add, abort, release, take over a prefilled request, fail): actor calls the client numbers and the
  host runs in that order. Ray does not order an async actor's calls (a large argument can hold one back), and an
  abort must never overtake the add it aborts.

A decode replica's take-over runs here, next to the engine: the reservation of pages, the READs (by the ranks' KV
managers) and the start of decoding cost the replica's process one command, and the first output arrives on the
request's stream like any other.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextvars
import dataclasses
import inspect
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from actors.chunks import ends, error_chunk, error_from, token_chunk
from actors.engine_loop import EngineStopped, ReservationQueue, hand_over, name_native_thread
from actors.nixl_transfer import TransferError
from actors.worker import RankWorker, kv_manager
from engine.llm_engine import LLMEngine, RequestOutput
from engine.sequence import SamplingParams

log = logging.getLogger(__name__)


def detached(fn, *args):
    """``fn(*args)`` outside the calling Ray task. An async actor finds the task that submits a call through a
    context variable, and cancelling a task cancels what it submitted: a clean-up call made while its request
    is being cancelled (a client went away) would be cancelled with it."""
    return contextvars.Context().run(fn, *args)


@dataclasses.dataclass(frozen=True)
class PrefillPages:
    """A prefilled request's pages on its prefill replica, held under a lease per prefill rank: what a decode
    take-over READs, or gives back (the part of ``actors.replica.Ticket`` the engine's process needs)."""

    request_id: str
    tables: list[list[int]]        # per space: the prefill pages of the prompt (the same ids on every rank)
    leases: list[str]              # per prefill rank: the lease its KV manager holds the pages under
    peer_agents: list[str]         # per prefill rank: its NIXL agent, also its KVManagerActor's name

    def cancel(self, ranks: Sequence[int] | None = None) -> None:
        """Give the held pages back now (the request will not be decoded), on every prefill rank or on ``ranks``.
        Safe to call from a request that is being cancelled."""
        for rank, (agent, lease) in enumerate(zip(self.peer_agents, self.leases)):
            if ranks is not None and rank not in ranks:
                continue
            try:
                detached(kv_manager(agent).cancel.remote, lease)
            except ValueError:      # that KV manager is gone, and its pages with it
                pass


class _Forward:
    """A request's stream on the host: what the engine loop hands over goes to the outbox, tagged; the first output
    as a chunk with ``first_extra`` in it when that is set (a take-over's transfer statistics)."""

    closed = False
    first_extra: dict | None = None

    def __init__(self, request_id: str, outbox: asyncio.Queue):
        self.request_id, self.outbox = request_id, outbox

    def put_nowait(self, item) -> None:
        if self.first_extra is not None and isinstance(item, RequestOutput):
            item, self.first_extra = token_chunk(item, **self.first_extra), None
        self.outbox.put_nowait((self.request_id, item))


@dataclasses.dataclass
class _TakeOver:
    """A decode take-over in progress: its stream, its task (held here: the event loop keeps only a weak
    reference), and whether the replica aborted it."""

    stream: _Forward
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


class EngineHost(RankWorker):
    """Rank 0 as an actor: builds the engine, steps it in its engine loop thread, runs the replica's numbered
    commands in order and streams the steps' outputs back (``outputs``)."""

    def __init__(self, config, kv_manager=None, *, kv_managers: Sequence = (), **kwargs):
        self._build_error: BaseException | None = None
        try:
            super().__init__(config, kv_manager, tp_rank=0, **kwargs)
        except Exception as e:      # told by ``ready`` as itself (a bad config is a ValueError to the replica)
            self._build_error = e
            return
        self.kv_managers = list(kv_managers)      # every rank's, in rank order: they READ a take-over's pages
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._reservations = ReservationQueue(self.loop)
        self._taking: dict[str, _TakeOver] = {}
        self._next = 0                                   # the number of the command that runs next
        self._turns: dict[int, asyncio.Future] = {}     # commands that arrived before their turn

    def ready(self) -> None:
        if self._build_error is not None:
            raise self._build_error

    def describe(self) -> dict:
        return {"page_size": self.engine.kv.page_size}

    async def outputs(self):
        """Streamed to the replica (one call for its life): per engine step, the ``(request_id, item)`` pairs it
        handed over, an item being a token chunk, a finishing ``(chunk, on_finish result)`` or an error chunk."""
        while True:
            items = [await self._outbox.get()]
            while not self._outbox.empty():
                items.append(self._outbox.get_nowait())
            yield [(request_id, _wire(item)) for request_id, item in items]

    async def command(self, number: int, name: str, *args) -> Any:
        """Run command ``number`` once every lower-numbered one has been handed to the engine loop."""
        if number != self._next:
            turn = self._turns[number] = asyncio.get_running_loop().create_future()
            await turn
        try:
            pending = getattr(self, f"_do_{name}")(*args)     # hands its work to the engine loop, in order
        finally:
            self._next = number + 1
            waiting = self._turns.pop(self._next, None)
            if waiting is not None:
                waiting.set_result(None)
        return await pending if inspect.isawaitable(pending) else pending

    def _open(self, request_id: str, on_finish=None) -> _Forward:
        return self.loop.open_stream(request_id, on_finish, queue=_Forward(request_id, self._outbox))

    # --- commands: each hands its work to the engine loop before returning (an awaitable for its result) -------
    def _do_noop(self) -> None:
        return None

    def _do_start(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, hold_pages: bool,
                  on_finish: Callable[[LLMEngine, RequestOutput], Any] | None):
        self._open(request_id, on_finish)
        added = self.loop.call(lambda e: e.add_request(prompt_token_ids, params, request_id=request_id,
                                                        hold_pages=hold_pages))
        return self._started(request_id, added)

    async def _started(self, request_id: str, added: asyncio.Future) -> dict | None:
        try:
            await added
            return None
        except (ValueError, EngineStopped) as e:
            self.loop.close_stream(request_id)
            return error_chunk(400, str(e), "invalid_request_error") if isinstance(e, ValueError) else error_from(e)

    def _do_abort(self, request_id: str) -> None:
        self.loop.abort(request_id)       # a request whose READ runs keeps its pages until the READ ends
        taking = self._taking.get(request_id)
        if taking is not None:            # still waiting for pages: stop waiting; granted: freed, never READ
            taking.cancelled = True
            self.loop.submit(lambda _: self._reservations.forget(request_id))

    def _do_release(self, request_id: str) -> None:
        self.loop.submit(lambda e: e.release(request_id))

    def _do_take_over(self, pages: PrefillPages, attempt: Callable[[LLMEngine], Any], plan: list[list[int]],
                      draft_context: bool, reserve_timeout_s: float, read_timeout_s: float) -> None:
        """Decode side: reserve pages for a prefilled request (``attempt``: ``actors.replica._reserve``), have
        every rank's KV manager READ its KV into them, and start decoding it. Its stream gets the first output,
        carrying the transfer's statistics, or an error chunk. An abort stops it wherever it is, and its pages
        are freed only once no READ can write into them."""
        request_id = pages.request_id
        taking = self._taking[request_id] = _TakeOver(self._open(request_id))
        waiter = self._reservations.begin(request_id, attempt)
        taking.task = asyncio.get_running_loop().create_task(
            self._take_over(pages, taking, waiter, plan, draft_context, reserve_timeout_s, read_timeout_s),
            context=contextvars.Context())

    async def _take_over(self, pages: PrefillPages, taking: _TakeOver, waiter: concurrent.futures.Future,
                         plan: list[list[int]], draft_context: bool, reserve_timeout_s: float,
                         read_timeout_s: float) -> None:
        request_id = pages.request_id
        try:
            refused = None
            try:
                reserved = await self._reservations.wait(request_id, waiter, reserve_timeout_s)
            except Exception as e:
                reserved, refused = None, refusal(e)
            if reserved is None or taking.cancelled:
                await asyncio.to_thread(pages.cancel)       # nothing READs the prefill pages: give them back
                if reserved is not None:       # granted as the replica went away: no READ touches these pages
                    self.loop.submit(lambda e: e.finish_transfer(request_id, False))
                self.loop.deliver([(request_id, refused or error_chunk(503, "no decode KV pages free", "overloaded"))])
                return
            tables, reused = reserved
            stats, error = await self._read(pages, tables, reused, plan, draft_context, read_timeout_s)
            taking.stream.first_extra = {"transfer": stats}

            def finish(e: LLMEngine) -> None:
                out = e.finish_transfer(request_id, error is None, draft_context=draft_context)
                # Delivered from the engine thread, so it precedes this request's next step's output.
                self.loop.deliver([(request_id, out if error is None else _transfer_failure(pages, error))])

            self.loop.submit(finish)
        except Exception as e:       # a bug here must not leave the request's stream open
            log.exception("take-over of %s failed", request_id)
            self.loop.deliver([(request_id, e)])
        finally:
            self._taking.pop(request_id, None)

    async def _read(self, pages: PrefillPages, tables: list[list[int]], reused: int, plan: list[list[int]],
                    draft_context: bool, timeout_s: float) -> tuple[dict, BaseException | None]:
        """Every rank READs from the prefill ranks in its ``plan`` at once (equal TP: rank r from rank r) the
        pages after the ``reused`` leading ones this side already holds; returns once every READ has ended: the
        transfer's statistics, or the first error."""
        readers = collections.Counter(source for sources in plan for source in sources)
        unread = [source for source in range(len(pages.leases)) if not readers[source]]
        if unread:      # their heads come from other prefill ranks holding them too
            await asyncio.to_thread(pages.cancel, unread)
        reads = await asyncio.gather(*(
            kvm.read.remote(pages.leases[source], pages.peer_agents[source], [t[reused:] for t in pages.tables],
                            [t[reused:] for t in tables], draft_context, timeout_s, readers[source])
            for kvm, sources in zip(self.kv_managers, plan) for source in sources), return_exceptions=True)
        error = next((r for r in reads if isinstance(r, BaseException)), None)
        if error is not None:
            if len(reads) > 1:
                # A lease whose other readers ended while one failed before its READ began: give it back now.
                await asyncio.to_thread(pages.cancel)
            return {}, error
        return {"bytes": sum(r["bytes"] for r in reads), "seconds": max(r["seconds"] for r in reads),
                "lease_seconds": max(r["lease_seconds"] for r in reads),
                "descriptors": sum(r["descriptors"] for r in reads), "tables": tables, "reused_pages": reused,
                "transport": "+".join(sorted({r["transport"] for r in reads}))}, None

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
        """Batch sizes and pages in use per pool (with its owners), for the replica's metrics report."""
        gauges = await self.loop.call(engine_gauges)
        gauges["awaiting_transfer"] = len(self._taking)
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


class EngineClient:
    """The replica's side of its ``EngineHost``: per-request streams fed by the host's output stream (a thread
    receives each step's message and hands it to the streams' event loops, one wake-up each), and the commands,
    numbered. If the host dies every open stream ends with ``EngineStopped`` and later commands fail with it."""

    def __init__(self, host):
        self.host = host
        self.page_size: int = 0
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._failure: EngineStopped | None = None
        self._numbering = threading.Lock()
        self._number = 0
        self._pump = threading.Thread(target=self._receive, name="engine-outputs", daemon=True)

    def connect(self) -> None:
        """Open the output stream (the host must be built: its constructor has returned)."""
        import ray

        self.page_size = ray.get(self.host.describe.remote())["page_size"]
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
        import ray

        name_native_thread("engine-outputs")
        try:
            for ref in self.host.outputs.options(num_returns="streaming").remote():
                hand_over(self._streams, ray.get(ref), ends)
            error = EngineStopped("the engine process ended its output stream")
        except Exception as e:        # the host died (or was shut down)
            error = EngineStopped(f"this replica's engine process is gone ({type(e).__name__}); retry the request")
        self._end_streams(error)

    def _end_streams(self, error: EngineStopped) -> None:
        if self._failure is None:
            self._failure = error
        hand_over(self._streams, [(r, error_from(error)) for r in list(self._streams)], ends)

    # --- commands ---------------------------------------------------------------------------------------------
    def _command(self, name: str, *args):
        """Send command ``name``; its ObjectRef. Numbered under a lock, so that a number is never lost: a send
        that fails (an argument that does not pickle) sends a no-op in its place."""
        with self._numbering:
            number, self._number = self._number, self._number + 1
            try:
                return detached(self.host.command.remote, number, name, *args)
            except Exception:
                detached(self.host.command.remote, number, "noop")
                raise

    async def _result(self, ref) -> Any:
        import ray

        try:
            return await ref
        except ray.exceptions.RayActorError as e:
            raise EngineStopped(f"this replica's engine process is gone ({type(e).__name__}); retry the request")

    async def start(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                    hold_pages: bool = False, on_finish: Callable[[LLMEngine, RequestOutput], Any] | None = None
                    ) -> dict | None:
        """Add the request (its stream must be open); None, or the error chunk that refused it (bad input: 400;
        the engine stopped: 503). ``on_finish`` runs on the engine thread as the finished output is handed over
        (``EngineLoop.open_stream``): module-level, it travels by reference."""
        if self._failure is not None:
            return error_from(self._failure)
        try:
            return await self._result(self._command("start", request_id, list(prompt_token_ids), params, hold_pages,
                                                    on_finish))
        except EngineStopped as e:
            return error_from(e)

    def abort(self, request_id: str) -> None:
        """Abort and free the request's pages; safe in a cancelled coroutine's ``finally`` (nothing to await)."""
        self.close_stream(request_id)
        if self._failure is None:
            self._command("abort", request_id)

    def release(self, request_id: str) -> None:
        """Free a finished request's held pages."""
        if self._failure is None:
            self._command("release", request_id)

    def take_over(self, pages: PrefillPages, attempt: Callable[[LLMEngine], Any], plan: list[list[int]],
                  draft_context: bool, reserve_timeout_s: float, read_timeout_s: float) -> dict | None:
        """Have the host reserve pages for a prefilled request's prompt, READ its KV and start decoding it
        (``EngineHost._do_take_over``); its stream must be open. None once sent, or the error chunk when the
        engine has stopped. Nothing to await: its outcome arrives on the stream, and ``abort`` stops it."""
        if self._failure is not None:
            return error_from(self._failure)
        self._command("take_over", pages, attempt, plan, draft_context, reserve_timeout_s, read_timeout_s)
        return None

    def fail(self, error: EngineStopped) -> None:
        """Stop serving for good: open streams end with ``error`` now, later commands are refused, and the host
        stops computing (``EngineLoop.fail``)."""
        if self._failure is not None:
            return
        self._end_streams(error)
        try:
            self._command("fail", str(error))
        except Exception:      # the host is gone already
            pass

    @property
    def failed(self) -> bool:
        return self._failure is not None

    @property
    def alive(self) -> bool:
        return self._failure is None and self._pump.is_alive()
