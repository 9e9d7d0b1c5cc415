"""Rank 0's engine in a process of its own (``EngineHost``), and its replica's side of it (``EngineClient``).

A replica's event loop runs Serve's per-request streaming (or the offline driver's); its engine thread needs the
interpreter for the host work of every step. In one process they share one GIL, and on a GPU the engine thread
waited for it for a third of each step at 16 streams (``benchmarks/README.md``). So rank 0's engine runs in an
actor of its own on the replica's node and GPU share, and the two talk over two channels:

- outputs: one streaming actor call, open for the replica's life, that yields once per engine step what that
  step handed over for every request (token chunks, finishing results, errors) as one message;
- commands (add, abort, release, reserve pages, finish a transfer, fail): actor calls the client numbers and the
  host runs in that order. Ray does not order an async actor's calls (a large argument can hold one back), and an
  abort must never overtake the add it aborts.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import inspect
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from actors.chunks import ends, error_chunk, error_from, token_chunk
from actors.engine_loop import EngineStopped, ReservationQueue, hand_over, name_native_thread
from actors.worker import RankWorker
from engine.llm_engine import LLMEngine, RequestOutput
from engine.sequence import SamplingParams

log = logging.getLogger(__name__)


def detached(fn, *args):
    """``fn(*args)`` outside the calling Ray task. An async actor finds the task that submits a call through a
    context variable, and cancelling a task cancels what it submitted: a clean-up call made while its request
    is being cancelled (a client went away) would be cancelled with it."""
    return contextvars.Context().run(fn, *args)


class _Forward:
    """A request's stream on the host: what the engine loop hands over goes to the outbox, tagged."""

    closed = False

    def __init__(self, request_id: str, outbox: asyncio.Queue):
        self.request_id, self.outbox = request_id, outbox

    def put_nowait(self, item) -> None:
        self.outbox.put_nowait((self.request_id, item))


def _wire(item) -> Any:
    """What a handed-over item becomes on the way to the replica: a chunk, not the whole RequestOutput (its
    token lists and text grow with the request); an exception becomes its error chunk."""
    if isinstance(item, RequestOutput):
        return token_chunk(item)
    if isinstance(item, tuple):
        return token_chunk(item[0]), item[1]
    return error_from(item)


class EngineHost(RankWorker):
    """Rank 0 as an actor: builds the engine, steps it in its engine loop thread, runs the replica's numbered
    commands in order and streams the steps' outputs back (``outputs``)."""

    def __init__(self, config, kv_manager=None, **kwargs):
        self._build_error: BaseException | None = None
        try:
            super().__init__(config, kv_manager, tp_rank=0, **kwargs)
        except Exception as e:      # told by ``ready`` as itself (a bad config is a ValueError to the replica)
            self._build_error = e
            return
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._reservations = ReservationQueue(self.loop)
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

    def _open(self, request_id: str, on_finish=None) -> None:
        self.loop.open_stream(request_id, on_finish, queue=_Forward(request_id, self._outbox))

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
        self.loop.abort(request_id)

    def _do_release(self, request_id: str) -> None:
        self.loop.submit(lambda e: e.release(request_id))

    def _do_reserve(self, request_id: str, attempt: Callable[[LLMEngine], Any], timeout_s: float):
        return self._reserved(request_id, self._reservations.begin(request_id, attempt), timeout_s)

    async def _reserved(self, request_id: str, waiter: concurrent.futures.Future, timeout_s: float) -> dict:
        try:
            result = await self._reservations.wait(request_id, waiter, timeout_s)
        except EngineStopped as e:
            return {"error": error_from(e)}
        except Exception as e:
            status, kind = (400, "invalid_request_error") if type(e) is ValueError else (500, "server_error")
            return {"error": error_chunk(status, f"decode replica refused the request: {e}", kind)}
        return {"reserved": result}

    def _do_cancel_reservation(self, request_id: str) -> None:
        """The replica gave up on a request before its READ began: no READ touches its pages, free them."""
        def cancel(e: LLMEngine) -> None:
            self._reservations.forget(request_id)
            if request_id in e.requests:
                e.finish_transfer(request_id, False)

        self.loop.submit(cancel)

    def _do_finish_transfer(self, request_id: str, landed: bool, draft_context: bool, error: BaseException | None):
        self._open(request_id)

        def finish(e: LLMEngine) -> None:
            out = e.finish_transfer(request_id, landed, draft_context=draft_context)
            # Delivered from the engine thread, so it precedes this request's next step's output.
            self.loop.deliver([(request_id, out if landed else error)])

        return self.loop.call(finish)

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
        return await self.loop.call(engine_gauges)

    async def kv_head_counts(self) -> list[set[int]]:
        """Per pool, the kv-head counts of its layers on this rank."""
        return await self.loop.call(lambda e: [{s.num_kv_heads for s in pool.specs} for pool in e.kv.pools])


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
        ``(chunk, result)`` of an ``on_finish``)."""
        from actors.engine_loop import _Stream

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

    async def reserve(self, request_id: str, attempt: Callable[[LLMEngine], Any], timeout_s: float) -> dict:
        """``{"reserved": attempt's first result}`` (None when ``timeout_s`` passed first) or ``{"error": chunk}``;
        waiting behind older reservations (``ReservationQueue``)."""
        if self._failure is not None:
            return {"error": error_from(self._failure)}
        try:
            return await self._result(self._command("reserve", request_id, attempt, timeout_s))
        except EngineStopped as e:
            return {"error": error_from(e)}

    def cancel_reservation(self, request_id: str) -> None:
        if self._failure is None:
            self._command("cancel_reservation", request_id)

    async def finish_transfer(self, request_id: str, landed: bool, draft_context: bool,
                              error: BaseException | None) -> None:
        """The READ ended: the request decodes from the next step (its first output arrives on its stream), or,
        ``landed=False``, its stream gets ``error`` and its pages are freed."""
        if self._failure is not None:
            raise self._failure
        await self._result(self._command("finish_transfer", request_id, landed, draft_context, error))

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
