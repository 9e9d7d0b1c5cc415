"""Calls between actors of one node over a local socket, where a Ray actor call would cost a millisecond or more.

A hand-off from prefill to decode crosses processes several times (the ticket to the decode engine's process, the
READ to its KV manager, the lease check with the prefill KV manager, the lease's end), each one a Ray actor call
that took 1-2 ms on a GPU host, against a copy of a few hundred microseconds. Ray still starts, places, names and
supervises these actors; the calls on that path go over a socket between the two processes instead:

- ``ChannelServer``: owned by an async actor, it answers a fixed set of that actor's methods on the actor's event
  loop (as Ray would run them), in the order they arrive; ``info`` (itself a Ray call, once) says where.
- ``ActorLink``: the caller's side, per actor: over the channel when both run on one node, else (or if the socket
  cannot be reached: separate network namespaces) as Ray actor calls, with the same results and exceptions.

The socket is in Linux's abstract namespace (nothing on disk to clean up); a connection must first present a random
key that only Ray callers of ``info`` learn, and a frame is unpickled only after that.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import logging
import os
import pickle
import secrets
import socket
import struct
from collections.abc import Iterable

log = logging.getLogger(__name__)

_HEADER = struct.Struct("!Q")      # a frame: its length, then that many bytes (a pickle, or the key)
KEY_TIMEOUT_S = 10.0               # how long a connection may take to present its key


def frame(payload: bytes) -> bytes:
    return _HEADER.pack(len(payload)) + payload


def pickled(message) -> bytes:
    return frame(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


async def read_frame(reader: asyncio.StreamReader, limit: int | None = None) -> bytes:
    (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    if limit is not None and size > limit:
        raise ValueError(f"a {size}-byte frame where at most {limit} were expected")
    return await reader.readexactly(size)


def header_size() -> int:
    return _HEADER.size


def frame_size(header: bytes) -> int:
    return _HEADER.unpack(header)[0]


def listening_socket(name: str) -> tuple[socket.socket, str]:
    """A non-blocking Unix socket listening at a fresh abstract address (``name`` in it, for ``ss -x``)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    address = f"\0dflash-{name}-{os.getpid()}-{secrets.token_hex(8)}"
    listener.bind(address)
    listener.listen(64)
    listener.setblocking(False)
    return listener, address


def connect_local(address: str) -> socket.socket:
    """A connected socket to the local socket at ``address`` (abstract). OSError if unreachable."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(address)       # local: at once (asyncio's connect refuses abstract addresses)
    except OSError:
        sock.close()
        raise
    return sock


async def open_local(address: str, key: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to the local socket at ``address`` (abstract), ``key`` sent first. OSError if unreachable."""
    reader, writer = await asyncio.open_unix_connection(sock=connect_local(address))
    writer.write(frame(key))
    return reader, writer


async def presents_key(reader: asyncio.StreamReader, key: bytes) -> bool:
    """Whether a new connection's first frame, read within ``KEY_TIMEOUT_S``, is ``key``."""
    try:
        sent = await asyncio.wait_for(read_frame(reader, limit=len(key)), KEY_TIMEOUT_S)
    except (asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError, OSError):
        return False
    return hmac.compare_digest(sent, key)


def _reply_frame(call: int, ok: bool, value) -> bytes:
    try:
        return pickled((call, ok, value))
    except Exception as e:      # a result or an exception that does not pickle: told as text
        return pickled((call, False, RuntimeError(f"{type(e).__name__}: {e}")))


class ChannelServer:
    """Answers ``methods`` of ``target`` for callers on this node. Start it from the actor's event loop
    (``info``, called as a Ray method of the actor). Any number of connections, each with the key first."""

    def __init__(self, target, methods: Iterable[str], name: str):
        self.target = target
        self.methods = frozenset(methods)
        self.key = secrets.token_bytes(32)
        self._listener, self.address = listening_socket(name)
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()      # calls in flight (the event loop keeps weak references)
        self.calls = 0                              # calls answered or run so far (inspection, tests)

    async def info(self) -> dict:
        """Where to connect: this process's node, the address and the key. Starts serving on the running loop."""
        import ray

        if self._server is None:
            self._server = await asyncio.start_unix_server(self._serve, sock=self._listener)
        return {"node_id": ray.get_runtime_context().get_node_id(), "address": self.address, "key": self.key}

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        else:
            self._listener.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not await presents_key(reader, self.key):
            writer.close()
            return
        try:
            while True:
                call, name, args = pickle.loads(await read_frame(reader))
                self._run(writer, call, name, args)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass        # the caller went away; its calls still running finish (as Ray's would)
        except Exception:       # a frame that does not unpickle to a call: the stream is out of step, close it
            log.exception("a call on %s's channel could not be read; closing that connection",
                          type(self.target).__name__)
        finally:
            writer.close()

    def _run(self, writer: asyncio.StreamWriter, call: int | None, name: str, args: tuple) -> None:
        """Start method ``name`` now (so calls begin in the order they came); reply to a numbered ``call``."""
        self.calls += 1
        try:
            if name not in self.methods:
                raise AttributeError(f"{type(self.target).__name__}.{name} is not served over its channel")
            result = getattr(self.target, name)(*args)
        except Exception as e:
            if call is None:
                log.exception("%s over the channel failed", name)
            else:
                writer.write(_reply_frame(call, False, e))
            return
        if not inspect.isawaitable(result):
            if call is not None:
                writer.write(_reply_frame(call, True, result))
            return

        async def finish() -> None:
            try:
                value, ok = await result, True
            except Exception as e:
                value, ok = e, False
                if call is None:
                    log.warning("%s over the channel failed: %s", name, e)
            if call is not None and not writer.is_closing():
                writer.write(_reply_frame(call, ok, value))

        task = asyncio.ensure_future(finish())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


class ChannelClosed(ConnectionError):
    """The channel's other end went away (its actor died or closed it) before the call's reply came."""


class ChannelClient:
    """One connection to a ``ChannelServer``, used from the event loop that opened it."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self._reader, self._writer = reader, writer
        self._calls = 0
        self._replies: dict[int, asyncio.Future] = {}
        self._closed: ChannelClosed | None = None
        self._receiver = asyncio.get_running_loop().create_task(self._receive())

    @classmethod
    async def open(cls, info: dict) -> ChannelClient:
        return cls(*await open_local(info["address"], info["key"]))

    @property
    def closed(self) -> bool:
        return self._closed is not None

    async def call(self, name: str, *args):
        """Method ``name``'s result, or its exception raised here; ChannelClosed if the other end goes away."""
        if self._closed is not None:
            raise self._closed
        call, self._calls = self._calls, self._calls + 1
        reply = self._replies[call] = asyncio.get_running_loop().create_future()
        try:
            self._writer.write(pickled((call, name, args)))
        except BaseException:
            self._replies.pop(call, None)
            raise
        return await reply

    def send(self, name: str, *args) -> None:
        """Run method ``name`` there without waiting for it (nor learning how it ended)."""
        if self._closed is not None:
            raise self._closed
        self._writer.write(pickled((None, name, args)))

    async def _receive(self) -> None:
        reason = "the other end closed the channel"
        try:
            while True:
                call, ok, value = pickle.loads(await read_frame(self._reader))
                reply = self._replies.pop(call, None)
                if reply is not None and not reply.done():
                    reply.set_result(value) if ok else reply.set_exception(value)
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            reason = f"the channel broke ({type(e).__name__})"
        except Exception as e:       # a reply that did not unpickle: the stream is out of step from here
            log.exception("a channel reply could not be read")
            reason = f"a reply could not be read ({type(e).__name__})"
        finally:
            self.close(reason)

    def close(self, reason: str = "closed here") -> None:
        if self._closed is None:
            self._closed = ChannelClosed(reason)
        self._writer.close()
        replies, self._replies = self._replies, {}
        for reply in replies.values():
            if not reply.done():
                reply.set_exception(self._closed)
        if asyncio.current_task() is not self._receiver:
            self._receiver.cancel()


def _opened(connecting: asyncio.Future) -> None:
    if not connecting.cancelled() and connecting.exception() is not None:
        log.warning("opening a channel failed (%s); its calls go through Ray until the next try",
                    connecting.exception())


_node_id: str | None = None


def this_node() -> str:
    global _node_id
    if _node_id is None:
        import ray

        _node_id = ray.get_runtime_context().get_node_id()
    return _node_id


class ActorLink:
    """Calls to one actor that serves a channel (``channel_info``, a Ray method returning ``ChannelServer.info``):
    over it when the actor runs on this node, else as Ray actor calls. Used from one event loop. ``via`` says
    which, once known ("channel" or "ray")."""

    def __init__(self, actor):
        self.actor = actor
        self.via: str | None = None
        self._client: ChannelClient | None = None
        self._connecting: asyncio.Future | None = None

    async def connect(self) -> ChannelClient | None:
        """The channel (opened the first time, and again after it closed), or None: Ray calls it is."""
        if self._client is not None and not self._client.closed:
            return self._client
        if self.via == "ray":
            return None
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._open())
        try:
            return await asyncio.shield(self._connecting)
        finally:
            if self._connecting is not None and self._connecting.done():
                self._connecting = None

    def warm(self) -> None:
        """Start opening the channel in the background (the calls until it is open go through Ray)."""
        if self.via is None and self._connecting is None:
            self._connecting = asyncio.ensure_future(self._open())
            self._connecting.add_done_callback(_opened)

    async def _open(self) -> ChannelClient | None:
        info = await self.actor.channel_info.remote()
        if info["node_id"] != this_node():
            self.via = "ray"
            return None
        try:
            self._client = await ChannelClient.open(info)
        except OSError as e:      # same node, another network namespace (separate containers): Ray it is
            log.warning("cannot reach %s over its local socket (%s); calling it through Ray", info["address"][1:], e)
            self.via = "ray"
            return None
        self.via = "channel"
        return self._client

    @property
    def broken(self) -> bool:
        """Its channel was open and has closed (the actor is gone, most likely)."""
        return self._client is not None and self._client.closed

    async def call(self, name: str, *args):
        client = await self.connect()
        if client is None:
            return await getattr(self.actor, name).remote(*args)
        return await client.call(name, *args)

    def send(self, name: str, *args) -> None:
        """Not awaited: over the channel if it is open, else as a Ray call (whose result nobody reads)."""
        client = self._client
        if client is not None and not client.closed:
            client.send(name, *args)
        else:
            getattr(self.actor, name).remote(*args)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
