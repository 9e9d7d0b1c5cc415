"""Rank 0's engine in a process of its own (``actors.engine_host``): the commands run in the order the replica
numbered them whatever order Ray delivers them in, and a replica whose engine process dies ends its streams with
a retryable error at once and says so in its health check."""

import asyncio
import threading
import time

import pytest

pytestmark = pytest.mark.ray

import ray  # noqa: E402

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


def _reserve_numbers(client, n: int) -> int:
    """Take ``n`` command numbers from the client, to send those commands by hand."""
    with client._numbering:
        first, client._number = client._number, client._number + n
    return first


def test_commands_run_in_their_numbered_order_whatever_order_they_arrive_in(group):
    """An abort that reaches the host before the add it aborts waits for it: the held prefill is added, then
    aborted, and its pages are free. Run in arrival order, the abort would find nothing and the request would
    finish holding its pages."""
    first = _reserve_numbers(group.engine, 2)
    params = SamplingParams(max_tokens=1)
    abort = group.host.command.remote(first + 1, "abort", "held")
    time.sleep(1.0)
    assert ray.wait([abort], timeout=0)[0] == [], "the abort ran before the add it follows"
    refused = ray.get(group.host.command.remote(first, "start", "held", PROMPT, params, True, None), timeout=30)
    assert refused is None
    ray.get(abort, timeout=30)
    deadline = time.monotonic() + 10
    while ray.get(group.host.pages_in_use.remote()) != 0:
        assert time.monotonic() < deadline, "the aborted request kept its pages"
        time.sleep(0.1)
    # The check above can fail: a held prefill that nothing aborts keeps its pages.
    assert ray.get(group.host.command.remote(_reserve_numbers(group.engine, 1), "start", "held2", PROMPT, params,
                                             True, None), timeout=30) is None
    deadline = time.monotonic() + 10
    while ray.get(group.host.pages_in_use.remote()) == 0:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    group.engine.abort("held2")
    deadline = time.monotonic() + 10
    while ray.get(group.host.pages_in_use.remote()) != 0:
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_a_command_that_cannot_be_sent_does_not_stall_the_ones_after_it(group):
    """Its number goes to a no-op in its place; else every later command would wait for it forever."""
    with pytest.raises(TypeError):
        group.engine._command("start", "bad", PROMPT, SamplingParams(max_tokens=2), False, threading.Lock())

    async def run():
        queue = group.engine.open_stream("good")
        assert await asyncio.wait_for(group.engine.start("good", PROMPT, SamplingParams(max_tokens=3)), 30) is None
        chunks = [await asyncio.wait_for(queue.get(), 30)]
        while not chunks[-1]["finished"]:
            chunks.append(await asyncio.wait_for(queue.get(), 30))
        return sum(len(c["token_ids"]) for c in chunks)

    assert asyncio.run(run()) == 3


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
