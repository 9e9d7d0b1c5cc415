"""Token chunks sent by engine processes straight to the process that streams them to clients.

A replica relays its engine's chunks to its caller: a Serve stream per request, each chunk pickled, sent over gRPC,
unpickled and woken for on its own, in the replica's process and in the ingress's. The engine's process already
sends one message per step for every request (``actors.engine_host``); a ``ChunkSink`` lets it send that message
to the ingress itself. The ingress still calls the replica through Serve (routing, queue lengths for the autoscaler,
a cancel on disconnect, failures of the replica or its process): only the chunks take the short way.

- ``ChunkSink`` (the ingress's side): a listening local socket; the engine processes that serve its requests
  connect to it, present its key, and send frames of ``(request_id, chunk)`` pairs, which it puts into the queues
  of the requests it opened (``open``). ``SinkAddress`` says where it is, with each request.
- The engine's process (``EngineHost``) connects on the first request that names a sink, once per sink, and
  sends each step's chunks for that sink as one frame. A sink on another node, or one it cannot reach, gets the
  chunks relayed by the replica as before; a sink that goes away (its ingress ended) has its requests aborted.
- The replica's stream of such a request carries no token: it ends with the request (its error chunk, if the
  replica or its engine's process failed).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import pickle
import secrets

from actors.channel import listening_socket, presents_key, read_frame

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SinkAddress:
    """Where a sink listens: its node, its socket (Linux's abstract namespace) and the key a connection presents
    first. ``name`` tells sinks apart (an engine's process keeps one connection per name)."""

    name: str
    node_id: str
    address: str
    key: bytes = dataclasses.field(repr=False)


class ChunkSink:
    """The receiving end, on one event loop (the ingress's): per request a queue of the chunks sent to it."""

    def __init__(self, name: str):
        self.name = name
        self._key = secrets.token_bytes(32)
        self._listener, self._address = listening_socket(f"sink-{name}")
        self._server: asyncio.AbstractServer | None = None
        self._starting: asyncio.Future | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._readers: set[asyncio.Task] = set()
        self.frames = 0     # frames received (inspection, tests)
        self.chunks = 0     # chunks put into a request's queue

    async def address(self) -> SinkAddress:
        """Where engine processes send this sink's chunks; starts listening on the running loop (once)."""
        import ray

        if self._starting is None:      # the first request: start listening (once, however many come at once)
            self._starting = asyncio.ensure_future(asyncio.start_unix_server(self._serve, sock=self._listener))
            self._where = SinkAddress(self.name, ray.get_runtime_context().get_node_id(), self._address, self._key)
        self._server = await asyncio.shield(self._starting)
        return self._where

    def open(self, request_id: str) -> asyncio.Queue:
        """The queue of ``request_id``'s chunks. ValueError while a request with this id is open here."""
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already open on this sink")
        q = self._queues[request_id] = asyncio.Queue()
        return q

    def close(self, request_id: str) -> None:
        """Stop receiving for ``request_id``: chunks that still come for it are dropped."""
        self._queues.pop(request_id, None)

    def shutdown(self) -> None:
        """Stop listening and drop every connection: the engine processes abort the requests they were sending."""
        if self._server is not None:
            self._server.close()
        else:
            self._listener.close()
        for task in list(self._readers):
            task.cancel()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not await presents_key(reader, self._key):
            writer.close()
            return
        task = asyncio.current_task()
        self._readers.add(task)
        try:
            while True:
                kind, pairs = pickle.loads(await read_frame(reader))
                if kind != "out":
                    raise ValueError(f"a {kind!r} frame on a chunk sink")
                self.frames += 1
                for request_id, chunk in pairs:
                    q = self._queues.get(request_id)
                    if q is not None:       # else its request ended here (a disconnect): dropped
                        q.put_nowait(chunk)
                        self.chunks += 1
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass        # the engine's process ended: its replica's Serve stream tells the requests why
        except Exception:
            log.exception("a frame on chunk sink %s could not be read; closing that connection", self.name)
        finally:
            self._readers.discard(task)
            writer.close()
