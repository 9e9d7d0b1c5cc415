"""One background thread per replica that owns the synchronous engine and streams its outputs to asyncio.

Only the loop thread touches the engine: every add, abort, reserve or inspection is a command it runs
between steps, and every step's outputs go to per-request asyncio queues via ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from engine.llm_engine import LLMEngine, RequestOutput

log = logging.getLogger(__name__)


class EngineLoop:
    def __init__(self, engine: LLMEngine, idle_wait_s: float = 0.05):
        self.engine = engine
        self.idle_wait_s = idle_wait_s
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # --- called from asyncio --------------------------------------------------------------------
    def submit(self, fn: Callable[[LLMEngine], Any]) -> concurrent.futures.Future:
        """Run ``fn(engine)`` on the loop thread between steps (callable from any thread)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, future))
        return future

    def call(self, fn: Callable[[LLMEngine], Any]) -> asyncio.Future:
        """``submit`` for coroutines: await the result."""
        return asyncio.wrap_future(self.submit(fn))

    def open_stream(self, request_id: str) -> asyncio.Queue:
        """A queue that receives this request's RequestOutputs (the last one has ``finished``)."""
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        return q

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def abort(self, request_id: str) -> concurrent.futures.Future:
        """Abort and free the request's pages; safe in a cancelled coroutine's ``finally`` (nothing to await)."""
        self.close_stream(request_id)
        return self.submit(lambda engine: engine.abort(request_id))

    def shutdown(self) -> None:
        self._stop.set()
        self._commands.put(None)
        self._thread.join(timeout=5)

    # --- the loop thread ------------------------------------------------------------------------
    def _run_commands(self, block: bool) -> None:
        try:
            item = self._commands.get(timeout=self.idle_wait_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            fn, future = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self.engine))
                except BaseException as e:     # the caller sees the error; the loop keeps running
                    future.set_exception(e)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            target = self._streams.get(out.request_id)
            if target is None:
                continue
            loop, q = target
            if out.finished:
                self._streams.pop(out.request_id, None)
            try:
                loop.call_soon_threadsafe(q.put_nowait, out)
            except RuntimeError:       # the consumer's event loop closed: nobody is listening any more
                pass

    def deliver(self, out: RequestOutput) -> None:
        """Hand an output produced by a command (e.g. a transfer's activation) to its stream."""
        self._deliver([out])

    def _fail_all(self, error: BaseException) -> None:
        for request_id, (loop, q) in list(self._streams.items()):
            self._streams.pop(request_id, None)
            self.engine.abort(request_id)
            try:
                loop.call_soon_threadsafe(q.put_nowait, error)
            except RuntimeError:
                pass

    def _run(self) -> None:
        while not self._stop.is_set():
            busy = self.engine.has_unfinished()
            self._run_commands(block=not busy)
            if self._stop.is_set() or not self.engine.has_unfinished():
                continue
            try:
                self._deliver(self.engine.step())
            except Exception as e:
                # The engine already finished (and freed) the step's requests; tell every waiting stream.
                log.exception("engine step failed")
                self._fail_all(e)
