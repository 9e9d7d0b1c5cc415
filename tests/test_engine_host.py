"""Rank 0's engine in a process of its own (``actors.engine_host``): the commands run in the order the replica sent
them, its socket serves its replica only, and a replica whose engine process dies ends its streams with a retryable
error at once and says so in its health check."""

import asyncio
import pickle
import socket
import struct
import threading
import time

import pytest

pytestmark = pytest.mark.ray

import ray  # noqa: E402

from actors.channel import frame as _frame  # noqa: E402
from actors.engine_host import EngineHost  # noqa: E402
from actors.replica import AggregatedReplica  # noqa: E402
from actors.worker import RankGroup  # noqa: E402
from engine.llm import EngineConfig  # noqa: E402
from engine.sequence import SamplingParams  # noqa: E402

PROMPT = [(5 * j) % 100 + 1 for j in range(40)]


@pytest.fixture
def group(ray_cluster, tiny_target):
    g = RankGroup("aggregated", EngineConfig(model=str(tiny_target), page_size=16, num_pages=32), transfers=False)
    yield g
    g.shutdown()


def _pages_reach(group, done, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not done(ray.get(group.host.pages_in_use.remote())):
        assert time.monotonic() < deadline, ray.get(group.host.pages_in_use.remote())
        time.sleep(0.05)


def test_commands_run_in_the_order_sent(group):
    """Adds of held prefills each followed at once by their abort, nothing awaited in between: every abort finds
    its request, and the pages come back. An abort run before its add would find nothing, and its request would
    finish holding its pages (the control at the end: a held prefill nobody aborts keeps them)."""
    params = SamplingParams(max_tokens=1)
    for i in range(12):
        group.engine._command("start", f"held{i}", PROMPT, params, True, None)
        group.engine.abort(f"held{i}")
    _pages_reach(group, lambda n: n == 0)
    assert ray.get(group.host.pages_in_use.remote()) == 0
    group.engine._command("start", "kept", PROMPT, params, True, None)
    _pages_reach(group, lambda n: n > 0)
    group.engine.abort("kept")
    _pages_reach(group, lambda n: n == 0)


def _generate(client, request_id: str, n: int) -> int:
    async def run():
        queue = client.open_stream(request_id)
        assert await asyncio.wait_for(client.start(request_id, PROMPT, SamplingParams(max_tokens=n)), 30) is None
        chunks = [await asyncio.wait_for(queue.get(), 30)]
        while not chunks[-1]["finished"]:
            chunks.append(await asyncio.wait_for(queue.get(), 30))
        return sum(len(c["token_ids"]) for c in chunks)

    return asyncio.run(run())


def test_a_command_whose_arguments_do_not_pickle_sends_nothing(group):
    """It raises in the caller, and the commands after it run: half a frame on the socket would garble them."""
    with pytest.raises(TypeError):
        group.engine._command("start", "bad", PROMPT, SamplingParams(max_tokens=2), False, threading.Lock(),
                              reply=True)
    assert _generate(group.engine, "good", 3) == 3


def test_a_refused_start_ends_its_stream_with_a_400_and_the_next_request_runs(group):
    """A start asks for no reply (an added request sends nothing back through the engine process's event loop);
    a request the engine refuses (a token id outside the vocabulary) gets a 400 as its stream's one item, holds no
    page, and the request after it is served."""
    client = group.engine

    async def run() -> dict:
        queue = client.open_stream("refused")
        assert await client.start("refused", [10**6] * 3, SamplingParams(max_tokens=3)) is None
        item = await asyncio.wait_for(queue.get(), 30)
        await asyncio.sleep(0.2)
        assert queue.empty()
        client.close_stream("refused")
        return item

    item = asyncio.run(run())
    assert (item["type"], item["status"], item["error_type"]) == ("error", 400, "invalid_request_error"), item
    assert "token ids" in item["message"]
    assert ray.get(group.host.pages_in_use.remote()) == 0
    assert _generate(client, "after", 3) == 3


def test_a_caller_that_stops_waiting_for_its_reply_leaves_the_replica_serving(group):
    """A client that leaves while its command's reply is on its way (a stand-by's; here a start sent asking for one:
    Serve cancels the replica's call, which cancels the reply's future): the reply that comes later is dropped, the replica's receiving thread goes on, and
    the request's stream and the next requests are served. Taking the reply into the cancelled future raised there
    once, which ended every stream of the replica and failed its health check."""
    client = group.engine

    async def drain(queue) -> list[dict]:
        chunks = [await asyncio.wait_for(queue.get(), 30)]
        while not chunks[-1].get("finished") and chunks[-1].get("type") != "error":
            chunks.append(await asyncio.wait_for(queue.get(), 30))
        return chunks

    async def run():
        queue = client.open_stream("left")
        for _ in range(20):     # the future must be cancelled before the reply comes back (about a millisecond)
            reply = client._command("start", "left", PROMPT, SamplingParams(max_tokens=4), False, None, reply=True)
            if reply.cancel():
                break
            await drain(queue)      # answered first: let that one finish, and try again
        else:
            pytest.fail("every reply came back before its future could be cancelled")
        chunks = await drain(queue)     # the request itself still runs to its end
        assert chunks[-1].get("type") != "error" and sum(len(c["token_ids"]) for c in chunks) == 4, chunks
        client.close_stream("left")

    asyncio.run(run())
    assert client.alive
    assert _generate(client, "after", 3) == 3
    _pages_reach(group, lambda n: n == 0)


def test_the_engine_socket_serves_its_replica_only(ray_cluster, tiny_target):
    """Before its replica connects, a connection with a wrong key or a garbled frame is closed unread (a command
    after it does not run: the engine still serves); the one with the key is answered; after it the socket
    takes no other connection, the right key or not."""
    host = ray.remote(EngineHost).options(num_cpus=0).remote(
        EngineConfig(model=str(tiny_target), page_size=16, num_pages=32))
    try:
        ray.get(host.ready.remote(), timeout=120)
        info = ray.get(host.describe.remote())
        intruder_command = _frame(pickle.dumps((None, "fail", ("an intruder",))))

        def connect() -> socket.socket:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(30)
            s.connect(info["address"])
            return s

        def closed_unread(first: bytes) -> bool:
            with connect() as s:
                s.sendall(first + intruder_command)
                try:
                    return s.recv(1) == b""
                except ConnectionResetError:
                    return True

        assert closed_unread(_frame(b"x" * len(info["key"])))
        assert closed_unread(struct.pack("!Q", 1 << 40))
        assert ray.get(host.problem.remote()) is None, "a command from a connection without the key ran"
        with connect() as replica:
            replica.sendall(_frame(info["key"]) + _frame(pickle.dumps((7, "release", ("nothing",)))))
            incoming = replica.makefile("rb")
            size = struct.unpack("!Q", incoming.read(8))[0]
            assert pickle.loads(incoming.read(size)) == ("reply", 7, True, None)
            with pytest.raises(ConnectionRefusedError):
                connect()
    finally:
        ray.kill(host)


def test_a_replica_whose_engine_process_dies_fails_its_streams_at_once_and_its_health_check(ray_cluster, tiny_target):
    replica = AggregatedReplica(EngineConfig(model=str(tiny_target), page_size=16, num_pages=64))
    try:
        async def run():
            stream = replica.generate("long", PROMPT, SamplingParams(max_tokens=400, ignore_eos=True))
            first = await asyncio.wait_for(stream.__anext__(), 60)
            assert first["type"] == "tokens" and first["token_ids"]
            ray.kill(replica.group.host)
            killed = time.monotonic()
            rest = [chunk async for chunk in stream]
            return rest, time.monotonic() - killed

        rest, after = asyncio.run(run())
        assert rest[-1]["type"] == "error" and rest[-1]["status"] == 503, rest[-1]
        assert "engine process is gone" in rest[-1]["message"]
        assert after < 10, f"the stream ran on for {after:.1f} s after its engine died"
        problems = replica.group.health_problems(timeout_s=5)
        assert any(p.rank == 0 and p.fatal for p in problems), problems
        with pytest.raises(RuntimeError, match="cannot serve"):
            asyncio.run(replica.check_health())

        async def later():
            return [chunk async for chunk in replica.generate("after", PROMPT, SamplingParams(max_tokens=4))]

        refused = asyncio.run(later())
        assert len(refused) == 1 and refused[0]["status"] == 503, refused
    finally:
        replica.shutdown()


def test_a_stalled_engine_fails_its_streams_when_serve_gives_the_replica_up(ray_cluster, tiny_target):
    """An engine process that stops answering (stalled, not dead: SIGSTOP here) fails health checks without failing
    its requests, since it may recover; at the check after which Serve stops the replica (``UNHEALTHY_CHECKS``), the
    streams end with a retryable error, where they waited out Serve's graceful shutdown before (37 s in a trial)."""
    import os
    import signal

    from actors.replica import UNHEALTHY_CHECKS

    replica = AggregatedReplica(EngineConfig(model=str(tiny_target), page_size=16, num_pages=64))
    replica.health_timeout_s = 0.5
    pid = ray.get(replica.group.host.__ray_call__.remote(lambda _: os.getpid()))
    try:
        async def run():
            stream = replica.generate("long", PROMPT, SamplingParams(max_tokens=400, ignore_eos=True))
            first = await asyncio.wait_for(stream.__anext__(), 60)
            assert first["type"] == "tokens" and first["token_ids"]
            os.kill(pid, signal.SIGSTOP)
            for check in range(UNHEALTHY_CHECKS):
                with pytest.raises(RuntimeError, match="cannot serve"):
                    await replica.check_health()
                if check < UNHEALTHY_CHECKS - 1:
                    assert not replica.engine.failed        # a stall may pass: the requests go on waiting
            return await asyncio.wait_for(collect(stream), 10)      # at once, not after Serve's shutdown wait

        async def collect(stream):
            return [chunk async for chunk in stream]

        rest = asyncio.run(run())
        assert rest[-1]["type"] == "error" and rest[-1]["status"] == 503, rest[-1]
        assert "stopped answering" in rest[-1]["message"], rest[-1]
    finally:
        os.kill(pid, signal.SIGCONT)
        replica.shutdown()
