"""Token chunks sent by the engine's process straight to the caller's sink (``actors.sink``): the same chunks as
relayed by the replica, the replica's stream carrying none of them; relayed when the sink is on another node or
cannot be reached; and a sink that goes away has its requests aborted and their pages freed."""

import asyncio
import dataclasses
import time

import pytest

pytestmark = pytest.mark.ray

import ray  # noqa: E402

from actors.chunks import ended_chunk  # noqa: E402
from actors.replica import AggregatedReplica  # noqa: E402
from actors.sink import ChunkSink, SinkAddress  # noqa: E402
from engine.llm import EngineConfig  # noqa: E402
from engine.sequence import SamplingParams  # noqa: E402

PROMPT = [(7 * j) % 100 + 1 for j in range(30)]
PARAMS = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def replica(ray_cluster, tiny_target):
    r = AggregatedReplica(EngineConfig(model=str(tiny_target), page_size=16, num_pages=64))
    yield r
    r.shutdown()


async def _drain(stream) -> list[dict]:
    return [chunk async for chunk in stream]


async def _from_sink(queue: asyncio.Queue) -> list[dict]:
    chunks = [await asyncio.wait_for(queue.get(), 30)]
    while chunks[-1]["type"] == "tokens" and not chunks[-1]["finished"]:
        chunks.append(await asyncio.wait_for(queue.get(), 30))
    return chunks


def _tokens(chunks: list[dict]) -> tuple[list[int], str]:
    assert all(c["type"] == "tokens" for c in chunks), chunks
    return [t for c in chunks for t in c["token_ids"]], "".join(c["text"] for c in chunks)


def _pages_free(replica, timeout_s: float = 10) -> int:
    deadline = time.monotonic() + timeout_s
    while (n := ray.get(replica.group.host.pages_in_use.remote())) and time.monotonic() < deadline:
        time.sleep(0.05)
    return n


def test_chunks_go_straight_to_the_sink_and_equal_the_relayed_ones(replica):
    async def run():
        sink = ChunkSink("test")
        where = await sink.address()
        relayed = await _drain(replica.generate("relayed", PROMPT, PARAMS))
        queue = sink.open("direct")
        through_replica = await _drain(replica.generate("direct", PROMPT, PARAMS, where))
        direct = await _from_sink(queue)
        frames = sink.frames
        by_loop_thread = ray.get(replica.group.host.__ray_call__.remote(
            lambda host: host._sinks[where.name].frames_sent_by_loop_thread))
        # A sink on another node (as the replica sees it) gets nothing: the replica relays.
        elsewhere = sink.open("elsewhere")
        other = await _drain(replica.generate("elsewhere", PROMPT, PARAMS, dataclasses.replace(where, node_id="x")))
        await asyncio.sleep(0.2)
        sink.shutdown()
        return relayed, through_replica, direct, frames, by_loop_thread, other, elsewhere.qsize()

    relayed, through_replica, direct, frames, by_loop_thread, other, misplaced = asyncio.run(run())
    assert through_replica == []        # the replica's stream ended with the request, carrying no chunk
    ids, text = _tokens(relayed)
    assert len(ids) == 24
    assert _tokens(direct) == (ids, text)
    assert direct[-1]["finish_reason"] == relayed[-1]["finish_reason"] == "length"
    assert direct[-1]["spec"] == relayed[-1]["spec"] and "timing" in direct[-1]
    assert 1 <= frames <= len(direct)       # a step's chunks as one frame
    # ... sent by the engine's loop thread itself (the first may go through the event loop while it connects)
    assert frames - 1 <= by_loop_thread <= frames
    assert _tokens(other) == (ids, text) and misplaced == 0
    assert _pages_free(replica) == 0


def test_a_sink_that_cannot_be_reached_gets_its_chunks_relayed(replica):
    """The sink's node is this one but its socket is not there (as in a separate network namespace): the engine's
    process cannot connect, and the replica relays the chunks instead."""
    async def run():
        expected = await _drain(replica.generate("expected", PROMPT, PARAMS))
        nowhere = SinkAddress("nowhere", ray.get_runtime_context().get_node_id(), "\0dflash-no-such-sink", b"k" * 32)
        return expected, await _drain(replica.generate("unreached", PROMPT, PARAMS, nowhere))

    expected, relayed = asyncio.run(run())
    assert _tokens(relayed) == _tokens(expected) and relayed[-1]["finished"]


def test_a_sink_that_goes_away_aborts_its_requests_and_frees_their_pages(replica):
    """Its ingress ended: nobody reads the request any more. The engine aborts it, its replica's stream ends with an
    error, its pages are freed, and the next request is served."""
    async def run():
        sink = ChunkSink("leaving")
        queue = sink.open("long")
        stream = asyncio.ensure_future(_drain(replica.generate(
            "long", PROMPT, SamplingParams(max_tokens=2000, ignore_eos=True), await sink.address())))
        first = await asyncio.wait_for(queue.get(), 60)
        sink.shutdown()
        return first, await asyncio.wait_for(stream, 30)

    first, rest = asyncio.run(run())
    assert first["type"] == "tokens" and first["token_ids"]
    assert len(rest) == 1 and rest[0]["type"] == "error" and rest[0]["status"] == 499, rest
    assert _pages_free(replica) == 0
    after = asyncio.run(_drain(replica.generate("after", PROMPT, SamplingParams(max_tokens=4))))
    assert len(_tokens(after)[0]) == 4


def test_a_sink_reads_only_connections_that_present_its_key(ray_cluster):
    """A connection whose first frame is not the sink's key is closed unread: its chunks never reach a request."""
    from actors.channel import open_local, pickled

    chunk = {"type": "tokens", "token_ids": [5], "text": "x", "finished": False, "finish_reason": None}

    async def run():
        sink = ChunkSink("keyed")
        where = await sink.address()
        queue = sink.open("r")
        reader, writer = await open_local(where.address, b"x" * len(where.key))
        writer.write(pickled(("out", [("r", {**chunk, "text": "forged"})])))
        closed_unread = await asyncio.wait_for(reader.read(), 10) == b""
        reader, writer = await open_local(where.address, where.key)
        writer.write(pickled(("out", [("r", chunk), ("not-open", chunk)])))
        got = await asyncio.wait_for(queue.get(), 10)
        writer.close()
        sink.shutdown()
        return closed_unread, got, queue.qsize(), sink.chunks

    closed_unread, got, left, delivered = asyncio.run(run())
    assert closed_unread and got == chunk and left == 0 and delivered == 1


@pytest.fixture(scope="module")
def prefill_replica(ray_cluster, tiny_target):
    from actors.replica import PrefillReplica

    r = PrefillReplica(EngineConfig(model=str(tiny_target), page_size=16, num_pages=64))
    yield r
    r.shutdown()


def test_a_prefill_sends_its_ticket_to_the_sink_and_holds_its_pages_until_the_lease_ends(prefill_replica):
    """The prefill engine's process issues the ticket (as it does for a relayed one), sends it to the sink and the
    holds to its KV manager: ending the leases frees the pages, which they would not without a hold."""
    async def run():
        sink = ChunkSink("prefill")
        where = await sink.address()
        relayed = await prefill_replica.prefill("relayed", PROMPT, PARAMS)
        queue = sink.open("direct")
        reply = await prefill_replica.prefill("direct", PROMPT, PARAMS, where)
        direct = await asyncio.wait_for(queue.get(), 30)
        sink.shutdown()
        return relayed, reply, direct

    relayed, reply, direct = asyncio.run(run())
    assert reply == {"sent": True} and direct["type"] == "prefilled"
    a, b = relayed["ticket"], direct["ticket"]
    assert (b.request_id, b.first_token, b.first_text, b.prompt_token_ids) == ("direct", a.first_token, a.first_text,
                                                                                 PROMPT)
    assert b.peer_agents == a.peer_agents and b.leases != a.leases and b.params == PARAMS
    assert ray.get(prefill_replica.group.host.pages_in_use.remote()) > 0
    a.cancel()
    b.cancel()
    assert _pages_free(prefill_replica) == 0


def test_stream_interval_holds_on_the_sink_path(ray_cluster, tmp_path):
    """Through HTTP, where the chunks come by the ingress's sink and the router batches them: with ``stream_interval``
    4 the first token goes alone, then an event every 4 engine steps at most (the last at once)."""
    import json

    import httpx

    from tests.test_serve_support import metric_samples, metric_sum, tiny_service

    body = {"model": "tiny", "prompt": [3, 4, 5, 6], "max_tokens": 32, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    with tiny_service(tmp_path, mode="aggregated", stream_interval=4) as url:
        events = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[len("data: "):]))
        by_sink = metric_sum(metric_samples(httpx.get(f"{url}/metrics", timeout=30).text),
                             "dflash_stream_chunks_total", path="sink")
    carrying = [e["choices"][0]["token_ids"] for e in events if e["choices"] and e["choices"][0].get("token_ids")]
    usage = events[-1]["usage"]
    steps = len(usage["spec_decode"]["acceptance_lengths"][0])     # engine steps after the first token's
    assert usage["completion_tokens"] == sum(map(len, carrying)) == 32 and steps >= 8
    assert len(carrying[0]) == 1
    assert 2 <= len(carrying) <= 2 + -(-steps // 4)
    assert by_sink >= len(carrying)


def test_what_the_socket_does_not_take_at_once_follows_in_order(ray_cluster):
    """``_SinkLink.send_step`` (the engine loop thread's send) on a sink that is not reading: a small send buffer
    fills, the rest of each frame and the frames after it go through the event loop, and once the sink reads
    every chunk arrives whole and in order, the request's end told to the replica's stream after its last chunk.
    (A real socket and a real sink; its reader is held only by not letting the event loop run.)"""
    import socket

    from actors.engine_host import _SinkLink
    from engine.llm_engine import RequestOutput

    n = 40

    def output(i: int) -> RequestOutput:
        return RequestOutput(request_id="big", prompt_token_ids=[1], token_ids=list(range(i + 1)), text="",
                             finished=i == n - 1, finish_reason="length" if i == n - 1 else None,
                             new_token_ids=[i], text_delta=f"{i:04d}" + "x" * 4000)

    async def run():
        sink = ChunkSink("backlog")
        queue = sink.open("big")
        relay: asyncio.Queue = asyncio.Queue()
        link = _SinkLink(await sink.address(), relay, abort=lambda request_id: None)
        link.track("big")
        while link._sock is None:
            await asyncio.sleep(0.01)
        link._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        for i in range(n):          # no await in between: the sink cannot read
            link.send_step([("big", output(i))])
        pending_after_sends = link._pending
        chunks = await _from_sink(queue)
        ended = await asyncio.wait_for(relay.get(), 10)
        while link._pending:
            await asyncio.sleep(0.01)
        sink.shutdown()
        return pending_after_sends, link.frames_sent_by_loop_thread, chunks, ended

    pending, direct, chunks, ended = asyncio.run(run())
    assert pending > 0 and direct < 40          # the socket stopped taking them: a backlog formed
    assert [c["token_ids"] for c in chunks] == [[i] for i in range(n)]
    assert [c["text"][:4] for c in chunks] == [f"{i:04d}" for i in range(n)]
    assert all(len(c["text"]) == 4004 for c in chunks) and chunks[-1]["finished"]
    assert ended == ("big", ended_chunk())
