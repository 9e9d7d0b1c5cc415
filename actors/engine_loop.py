"""One thread per replica that owns the synchronous engine and streams its outputs to asyncio.

Only the loop thread touches the engine: every add, abort, reserve or inspection is a command it runs
between steps. A step's outputs reach their per-request asyncio queues in one hand-off per event loop
(one wake-up, however many requests stepped). Idle, the thread blocks on its command queue.
Hooks (``add_hook``) run on the loop thread after every batch of commands and every step: the moments pages
can have been freed, so a waiter for pages (a decode reservation) retries exactly then, never on a timer.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from engine.llm_engine import LLMEngine, RequestOutput
from engine.parallel import PeerLost

log = logging.getLogger(__name__)


def name_native_thread(name: str) -> None:
    """Give the calling thread its name in the OS too (top -H, /proc, profilers), where the platform allows."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)    # 15: PR_SET_NAME
    except (OSError, AttributeError):
        pass


class LoopStats:
    """Where the loop thread's time goes, cumulative since it started: steps by kind (``prompt``: the step computed
    prompt tokens, ``decode``: only decode rows) with their wall time and the thread's CPU time within them (wall
    beyond CPU is time off the core: waiting for the GIL or blocked on the device), and the time it sat idle with
    nothing to run. Written by the loop thread only; ``snapshot`` there too (a command), adding the thread's and the
    process's whole CPU time."""

    KINDS = ("prompt", "decode")

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.steps = dict.fromkeys(self.KINDS, 0)
        self.step_s = dict.fromkeys(self.KINDS, 0.0)
        self.step_cpu_s = dict.fromkeys(self.KINDS, 0.0)
        self.idle_s = 0.0

    def add_step(self, kind: str, wall_s: float, cpu_s: float) -> None:
        self.steps[kind] += 1
        self.step_s[kind] += wall_s
        self.step_cpu_s[kind] += cpu_s

    def snapshot(self) -> dict:
        return {"steps": dict(self.steps), "step_s": dict(self.step_s), "step_cpu_s": dict(self.step_cpu_s),
                "idle_s": self.idle_s, "uptime_s": time.perf_counter() - self.started,
                "thread_cpu_s": time.thread_time(), "process_cpu_s": time.process_time()}


class EngineStopped(RuntimeError):
    """The loop stopped serving (its replica lost a rank, or it shut down): the request cannot run here."""


class EngineLoop:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, _Stream]] = {}
        self._finishers: dict[str, Callable[[LLMEngine, RequestOutput], Any]] = {}
        self._stop = threading.Event()
        self._hooks: list[Callable[[LLMEngine], None]] = []
        self._failure: BaseException | None = None     # set by ``fail``
        self._closing = threading.Lock()       # orders ``submit`` against the loop's final drain
        self.stats = LoopStats()
        # Set by the owner: takes the loop thread's prepared ``(request_id, item)`` pairs and the streams first, sends
        # what it can itself (popping the streams its items end) and returns the rest for the hand-over.
        self.direct: Callable[[list[tuple[str, Any]], dict], list[tuple[str, Any]]] | None = None
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # --- called from any thread -----------------------------------------------------------------
    def submit(self, fn: Callable[[LLMEngine], Any]) -> concurrent.futures.Future:
        """Run ``fn(engine)`` on the loop thread between steps."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._closing:
            if self._stop.is_set() or self._failure is not None:
                future.set_exception(self._failure or EngineStopped("the engine loop has stopped"))
            else:
                self._commands.put((fn, future))
        return future

    def add_hook(self, fn: Callable[[LLMEngine], None]) -> None:
        """Run ``fn(engine)`` on the loop thread after every batch of commands and every step (keep it cheap:
        return at once when it has nothing to do)."""
        self._hooks.append(fn)

    def call(self, fn: Callable[[LLMEngine], Any]) -> asyncio.Future:
        """``submit`` for coroutines: await the result."""
        return asyncio.wrap_future(self.submit(fn))

    def open_stream(self, request_id: str, on_finish: Callable[[LLMEngine, RequestOutput], Any] | None = None,
                    queue: asyncio.Queue | None = None) -> asyncio.Queue:
        """A queue that receives this request's RequestOutputs (the last one has ``finished``), or an
        exception if the engine failed it. With ``on_finish``, the finished output arrives as the pair
        ``(output, on_finish(engine, output))``, computed on the loop thread as the output is handed over (what
        needs the engine at that moment costs no second trip to the loop thread); an exception it raises
        arrives instead. ``queue``: where to put them instead of a new queue (anything with ``put_nowait`` and a
        ``closed`` flag; the engine host forwards them to its replica's process)."""
        q = _Stream() if queue is None else queue
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        if on_finish is not None:
            self._finishers[request_id] = on_finish
        return q

    def close_stream(self, request_id: str) -> None:
        """Stop the stream (call it on the event loop that opened it): what a step handed over but the event loop
        has not yet put in the queue is dropped, so nothing arrives after this returns."""
        target = self._streams.pop(request_id, None)
        self._finishers.pop(request_id, None)
        if target is not None:
            target[1].closed = True

    def abort(self, request_id: str) -> concurrent.futures.Future:
        """Abort and free the request's pages; safe in a cancelled coroutine's ``finally`` (nothing to await)."""
        self.close_stream(request_id)
        return self.submit(lambda engine: engine.abort(request_id))

    def deliver(self, items: list[tuple[str, Any]]) -> None:
        """Hand ``(request_id, RequestOutput | exception)`` items to their streams, one wake-up per event loop.
        Outputs are handed over on the loop thread (``on_finish`` runs here); exceptions from any thread. On the
        loop thread ``direct`` (if set) takes what it sends itself first: those items wake no event loop."""
        prepared = []
        for request_id, item in items:
            if request_id not in self._streams:
                continue
            if not isinstance(item, RequestOutput) or item.finished:
                finisher = self._finishers.pop(request_id, None)
                if finisher is not None and isinstance(item, RequestOutput):
                    try:
                        item = (item, finisher(self.engine, item))
                    except Exception as e:       # the request's own failure, told to its stream
                        item = e
            prepared.append((request_id, item))
        if self.direct is not None and prepared and threading.current_thread() is self._thread:
            prepared = self.direct(prepared, self._streams)
        hand_over(self._streams, prepared, _ends)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    @property
    def failed(self) -> bool:
        return self._failure is not None

    def fail(self, error: EngineStopped) -> None:
        """Stop serving for good: every open stream ends with ``error`` now, every later command fails with it,
        and the loop thread frees the requests' pages and stops after the command it is running. For a replica
        that lost a rank: the streams end even while the loop is stuck in a collective with the dead rank, and
        what it would still compute is left to the replica that replaces it (its CPU and GPU with it)."""
        def fail_all(engine: LLMEngine) -> None:
            for request_id in list(engine.requests):
                engine.abort(request_id)
            self.deliver([(r, error) for r in list(self._streams)])
            self._stop.set()

        with self._closing:
            if self._failure is not None or self._stop.is_set():
                return
            self._failure = error
            self._commands.put((fail_all, concurrent.futures.Future()))
        self.deliver([(r, error) for r in list(self._streams)])

    def shutdown(self) -> None:
        with self._closing:
            self._stop.set()
            self._commands.put(None)
        self._thread.join(timeout=5)

    # --- the loop thread ------------------------------------------------------------------------
    def _run_commands(self, block: bool) -> None:
        try:
            if block:
                idle_from = time.perf_counter()
                item = self._commands.get()
                self.stats.idle_s += time.perf_counter() - idle_from
            else:
                item = self._commands.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            fn, future = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self.engine))
                except BaseException as e:     # the caller sees the error; the loop keeps running
                    future.set_exception(e)
            if self._stop.is_set():      # failed or shut down: the rest fail in the final drain
                return
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _run_hooks(self) -> None:
        for hook in self._hooks:
            try:
                hook(self.engine)
            except Exception:      # a hook's failure is its own (it fails its waiters); the loop keeps running
                log.exception("engine loop hook failed")

    def _run(self) -> None:
        name_native_thread("engine-loop")
        while not self._stop.is_set():
            self._run_commands(block=not self.engine.has_unfinished())
            self._run_hooks()
            if self._stop.is_set() or not self.engine.has_unfinished():
                continue
            prompt_steps, began, cpu = self.engine.num_prompt_steps, time.perf_counter(), time.thread_time()
            try:
                outputs = self.engine.step()
            except Exception as e:
                # The engine already finished (and freed) the step's requests; tell their streams.
                log.exception("engine step failed")
                if isinstance(e, PeerLost):     # the rank group is broken for good: as a replica that lost a rank
                    e = EngineStopped("the replica serving this request lost a tensor-parallel rank; retry it")
                failed = [r for r in list(self._streams)
                          if r not in self.engine.requests or self.engine.requests[r].finished]
                for request_id in failed:
                    self.engine.abort(request_id)
                self.deliver([(r, e) for r in failed])
                if isinstance(e, EngineStopped):
                    self.fail(e)
                self._run_hooks()
                continue
            self.stats.add_step("prompt" if self.engine.num_prompt_steps != prompt_steps else "decode",
                                time.perf_counter() - began, time.thread_time() - cpu)
            self.deliver([(out.request_id, out) for out in outputs])
            self._run_hooks()
        with self._closing:       # what was submitted but never ran fails (later submits fail at once)
            self._stop.set()
            while True:
                try:
                    item = self._commands.get_nowait()
                except queue.Empty:
                    break
                if item is not None and item[1].set_running_or_notify_cancel():
                    item[1].set_exception(self._failure or EngineStopped("the engine loop has stopped"))


class ReservationQueue:
    """Requests waiting for engine capacity (a decode reservation waiting for free pages), granted oldest first.

    ``begin(request_id, attempt)`` runs ``attempt(engine)`` on the loop thread; while it returns None the request
    waits (``wait``, with a timeout), and the loop retries the oldest waiting attempt after every batch of commands
    and every step (the moments pages can have been freed), so a request gets its pages in the step they free up,
    with no timer. A later request never overtakes an older one that does not fit yet. The queue itself is touched on the
    loop thread only.
    """

    def __init__(self, loop: EngineLoop):
        self.loop = loop
        self._waiting: collections.OrderedDict[str, tuple[Callable, concurrent.futures.Future]] = \
            collections.OrderedDict()
        loop.add_hook(self._retry)

    def begin(self, request_id: str, attempt: Callable[[LLMEngine], Any]) -> concurrent.futures.Future:
        """Queue the first ``attempt`` on the loop thread now (in order with the commands submitted before and
        after it); the future gets its first result that is not None (None if ``forget`` comes first), or its
        error."""
        waiter: concurrent.futures.Future = concurrent.futures.Future()

        def first_try(engine):
            result = None if self._waiting else attempt(engine)      # behind older waiters, wait too
            if result is None:
                self._waiting[request_id] = (attempt, waiter)
            else:
                waiter.set_result(result)

        def failed(tried: concurrent.futures.Future) -> None:
            if tried.exception() is not None and not waiter.done():
                waiter.set_exception(tried.exception())

        self.loop.submit(first_try).add_done_callback(failed)
        return waiter

    async def wait(self, request_id: str, waiter: concurrent.futures.Future, timeout_s: float) -> Any:
        """``begin``'s result, or None once ``timeout_s`` has passed without one (the request stops waiting). An
        error ``attempt`` raised propagates. A caller that stops waiting otherwise must ``forget`` the request on
        the loop thread (and undo a grant that came first)."""
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(waiter)), timeout_s)
        except asyncio.TimeoutError:
            return await self.loop.call(lambda _: self._give_up(request_id, waiter))

    async def withdraw(self, request_id: str, waiter: concurrent.futures.Future) -> Any:
        """Stop waiting now: the grant, if one came first (the caller undoes it), else None (a failed attempt too)."""
        def give_up(_) -> Any:
            self._waiting.pop(request_id, None)
            return waiter.result() if waiter.done() and waiter.exception() is None else None

        return await self.loop.call(give_up)

    def forget(self, request_id: str) -> None:
        """Loop thread: stop waiting for ``request_id`` (a grant already made stands; a waiter gets None)."""
        entry = self._waiting.pop(request_id, None)
        if entry is not None and not entry[1].done():
            entry[1].set_result(None)

    def __len__(self) -> int:
        return len(self._waiting)

    def _give_up(self, request_id: str, waiter: concurrent.futures.Future) -> Any:
        # Serialised with ``_retry`` on the loop thread: either the grant came first (keep it) or none will.
        self._waiting.pop(request_id, None)
        return waiter.result() if waiter.done() else None

    def _retry(self, engine: LLMEngine) -> None:
        while self._waiting:
            request_id, (attempt, waiter) = next(iter(self._waiting.items()))
            try:
                result = attempt(engine)
            except Exception as e:       # this request's own failure: it is told, the others go on waiting
                del self._waiting[request_id]
                waiter.set_exception(e)
                continue
            if result is None:
                return
            del self._waiting[request_id]
            waiter.set_result(result)


class _Stream(asyncio.Queue):
    """A request's output queue; ``closed`` once its consumer closed it (set and read on the consumer's loop)."""
    closed = False


def _ends(item) -> bool:
    return not isinstance(item, RequestOutput) or item.finished


def hand_over(streams: dict[str, tuple[asyncio.AbstractEventLoop, Any]], items: list[tuple[str, Any]],
              ends: Callable[[Any], bool]) -> None:
    """Put ``(request_id, item)`` items into their streams in ``streams`` (request id -> its event loop and
    queue), one wake-up per event loop however many requests; a stream whose item ``ends`` it leaves
    ``streams``. Items of requests without a stream are dropped (their consumer went away)."""
    batches: dict[asyncio.AbstractEventLoop, list[tuple[Any, Any]]] = {}
    for request_id, item in items:
        target = streams.get(request_id)
        if target is None:
            continue
        if ends(item):
            streams.pop(request_id, None)
        batches.setdefault(target[0], []).append((target[1], item))
    for loop, batch in batches.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:       # the consumer's event loop closed: nobody is listening any more
            pass


def _put_all(batch: list[tuple[_Stream, Any]]) -> None:
    for q, item in batch:
        if not q.closed:
            q.put_nowait(item)
