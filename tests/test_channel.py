"""Calls between actors of one node over a local socket (``actors.channel``): the same results and exceptions as Ray
actor calls, in the order sent, to the served methods only, for callers with the key only; a caller's pending calls
fail at once when the actor dies; an actor on another node is called through Ray."""

import asyncio
import pickle
import socket

import pytest

pytestmark = pytest.mark.ray

import ray  # noqa: E402

from actors import channel  # noqa: E402
from actors.channel import ActorLink, ChannelClosed, ChannelServer, frame  # noqa: E402


class Echo:
    """An async actor serving some of its methods over a channel."""

    def __init__(self):
        self.log: list = []
        self.release = asyncio.Event()
        self._channel = ChannelServer(self, ("add", "seen", "fail", "wait", "plain"), "test")

    async def channel_info(self) -> dict:
        return await self._channel.info()

    def channel_calls(self) -> int:
        return self._channel.calls

    async def add(self, x):
        self.log.append(x)
        return x + 1

    async def seen(self) -> list:
        return list(self.log)

    async def fail(self, message: str):
        raise KeyError(message)

    async def wait(self) -> str:
        await self.release.wait()
        return "released"

    def plain(self, x):          # not a coroutine: answered at once
        return x * 2

    async def secret(self) -> str:     # not served over the channel
        return "secret"


@pytest.fixture
def echo(ray_cluster):
    actor = ray.remote(Echo).options(num_cpus=0).remote()
    yield actor
    ray.kill(actor)


def _run(coroutine, timeout_s: float = 30):
    return asyncio.run(asyncio.wait_for(coroutine, timeout_s))


def test_calls_over_the_channel_answer_as_ray_calls_do_in_the_order_sent(echo):
    async def run():
        link = ActorLink(echo)
        assert await link.call("add", 1) == 2
        assert link.via == "channel"
        for x in range(10, 20):
            link.send("add", x)          # not awaited: they still run before the call sent after them
        assert await link.call("plain", 21) == 42
        seen = await link.call("seen")
        with pytest.raises(KeyError, match="nope"):
            await link.call("fail", "nope")
        with pytest.raises(AttributeError, match="secret"):
            await link.call("secret")
        results = await asyncio.gather(*(link.call("add", x) for x in range(5)))
        link.close()
        return seen, results

    seen, results = _run(run())
    assert seen == [1, *range(10, 20)]
    assert results == [1, 2, 3, 4, 5]
    # Every one of those calls came over the channel, none as a Ray call (which the server does not count).
    assert ray.get(echo.channel_calls.remote()) == 1 + 10 + 1 + 1 + 1 + 1 + 5


def test_a_caller_without_the_key_is_closed_unread(echo):
    info = ray.get(echo.channel_info.remote())
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(info["address"])
        s.sendall(frame(b"x" * len(info["key"])) + frame(pickle.dumps((0, "add", (5,)))))
        try:
            assert s.recv(1) == b""
        except ConnectionResetError:
            pass
    assert ray.get(echo.seen.remote()) == []
    assert ray.get(echo.channel_calls.remote()) == 0


def test_a_pending_call_fails_at_once_when_the_actor_dies(echo):
    async def run():
        link = ActorLink(echo)
        await link.connect()
        pending = asyncio.ensure_future(link.call("wait"))
        await asyncio.sleep(0.2)
        ray.kill(echo)
        with pytest.raises(ChannelClosed):
            await asyncio.wait_for(pending, 10)
        return link.broken

    assert _run(run())


def test_an_actor_on_another_node_is_called_through_ray(echo, monkeypatch):
    """A fake, for what one machine cannot show: the caller's node id is made to differ from the actor's."""
    monkeypatch.setattr(channel, "_node_id", "another-node")

    async def run():
        link = ActorLink(echo)
        out = [await link.call("add", 3), await link.call("seen")]
        with pytest.raises(KeyError):
            await link.call("fail", "over ray")
        link.send("add", 7)         # Ray does not order an async actor's calls: wait for it
        for _ in range(100):
            if 7 in (seen := await link.call("seen")):
                break
            await asyncio.sleep(0.05)
        out.append(seen)
        return link.via, out

    via, (added, seen, seen_after) = _run(run())
    assert via == "ray"
    assert (added, seen, seen_after) == (4, [3], [3, 7])
    assert ray.get(echo.channel_calls.remote()) == 0


def test_a_garbled_call_closes_its_connection_only(echo):
    """A caller with the key whose frame is not a call loses its connection; the channel serves other callers."""
    info = ray.get(echo.channel_info.remote())
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(info["address"])
        s.sendall(frame(info["key"]) + frame(b"not a pickle"))
        try:
            assert s.recv(1) == b""
        except ConnectionResetError:
            pass

    async def run():
        link = ActorLink(echo)
        return await link.call("add", 41), link.via

    assert _run(run()) == (42, "channel")
