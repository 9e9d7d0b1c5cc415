"""The engine loop's reservation queue: a decode reservation that finds the pool full waits, and gets its pages
from the loop thread in the step or command that frees them (no timer); oldest first; a timeout leaves nothing
behind. Real engine (tiny pair, a pool of 8 pages), real engine loop; no Ray."""

import asyncio
import time

import pytest

from actors.engine_loop import EngineLoop, EngineStopped, ReservationQueue
from engine.llm import EngineConfig
from engine.sequence import SamplingParams
from spec_decode import build_engine
from tests import checkpoints

PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)
# 70 prompt tokens plus the drafter's lookahead: 5 pages of 16. One such request fits in 8 pages, two do not.
PROMPTS = [[(11 * i + 5 * j) % 120 + 1 for j in range(70)] for i in range(4)]


@pytest.fixture(scope="module")
def loop(tiny_target, tmp_path_factory):
    drafter = checkpoints.write_tiny_drafter(tmp_path_factory.mktemp("tiny_drafter"))
    engine = build_engine(EngineConfig(model=str(tiny_target), draft=str(drafter), num_pages=8))
    loop = EngineLoop(engine)
    yield loop
    loop.shutdown()


def attempt(request_id: str, prompt: list[int]):
    """What a decode replica's reservation runs on the loop thread: pages for a prompt whose KV will arrive."""
    def reserve(engine):
        request = engine.reserve_transfer(prompt, 5, PARAMS, request_id=request_id)
        return None if request is None else engine.kv.block_table(request_id, 0)
    return reserve


async def reserve(queue: ReservationQueue, request_id: str, attempt, timeout_s: float):
    """What the engine host does for a take-over: queue the first attempt now, then wait for the grant."""
    return await queue.wait(request_id, queue.begin(request_id, attempt), timeout_s)


def pages_in_use(loop: EngineLoop) -> int:
    return loop.submit(lambda e: e.kv.pages_in_use()).result(timeout=10)


def test_a_waiting_reservation_gets_the_pages_as_they_free_oldest_first(loop):
    queue = ReservationQueue(loop)

    async def scenario():
        first = await reserve(queue, "a", attempt("a", PROMPTS[0]), timeout_s=10)
        assert first is not None
        # The pool is full: these two wait, in arrival order.
        second = asyncio.ensure_future(reserve(queue, "b", attempt("b", PROMPTS[1]), timeout_s=10))
        third = asyncio.ensure_future(reserve(queue, "c", attempt("c", PROMPTS[2]), timeout_s=10))
        await asyncio.sleep(0.3)
        assert not second.done() and not third.done()
        assert len(queue) == 2
        # "a"'s READ failed: its pages go back on the loop thread, and "b" (the older) gets them at once.
        freed = time.monotonic()
        await loop.call(lambda e: e.finish_transfer("a", False))
        granted = await asyncio.wait_for(second, 5)
        waited = time.monotonic() - freed
        assert granted is not None and set(granted) & set(first)
        assert not third.done(), "a later reservation overtook or shared the pool with an older one"
        # "b" decodes to its end in the loop's steps; when it finishes, the step that freed its pages grants "c".
        await loop.call(lambda e: e.finish_transfer("b", True))
        assert await asyncio.wait_for(third, 10) is not None
        await loop.call(lambda e: e.finish_transfer("c", False))
        return waited

    waited = asyncio.run(scenario())
    assert waited < 1.0, f"the grant came {waited:.2f}s after the pages were freed"
    assert len(queue) == 0
    assert pages_in_use(loop) == 0


def test_a_reservation_that_times_out_leaves_nothing_behind(loop):
    queue = ReservationQueue(loop)

    async def scenario():
        assert await reserve(queue, "x", attempt("x", PROMPTS[0]), timeout_s=10) is not None
        held = pages_in_use(loop)
        start = time.monotonic()
        assert await reserve(queue, "y", attempt("y", PROMPTS[1]), timeout_s=0.3) is None
        assert 0.3 <= time.monotonic() - start < 5
        assert len(queue) == 0 and pages_in_use(loop) == held
        await loop.call(lambda e: e.finish_transfer("x", False))
        # Nothing still waits for "y": freed pages stay free.
        await asyncio.sleep(0.1)
        assert pages_in_use(loop) == 0
        await loop.call(lambda e: e.abort("y"))

    asyncio.run(scenario())
    assert pages_in_use(loop) == 0


def test_an_invalid_request_fails_and_does_not_block_the_queue(loop):
    queue = ReservationQueue(loop)

    async def scenario():
        with pytest.raises(ValueError):
            await reserve(queue, "bad", attempt("bad", []), timeout_s=1)       # an empty prompt
        assert len(queue) == 0
        granted = await reserve(queue, "ok", attempt("ok", PROMPTS[3]), timeout_s=5)
        assert granted is not None
        await loop.call(lambda e: e.finish_transfer("ok", False))

    asyncio.run(scenario())
    assert pages_in_use(loop) == 0


def test_a_failed_loop_ends_every_request_frees_their_pages_and_refuses_later_commands(tiny_target, tmp_path):
    """What a replica that lost a rank does (``EngineReplica.lost_rank``): the requests in flight end with the
    error at once instead of decoding on, their pages are freed, and nothing submitted later runs or hangs."""
    drafter = checkpoints.write_tiny_drafter(tmp_path)
    engine = build_engine(EngineConfig(model=str(tiny_target), draft=str(drafter), num_pages=64))
    loop = EngineLoop(engine)
    error = EngineStopped("lost a rank")
    long = SamplingParams(max_tokens=300, ignore_eos=True)

    async def scenario():
        streams = [loop.open_stream(r) for r in ("a", "b")]
        for request_id, prompt in zip(("a", "b"), PROMPTS):
            await loop.call(lambda e, r=request_id, p=prompt: e.add_request(p, long, request_id=r))
        for stream in streams:      # both are decoding
            assert not isinstance(await asyncio.wait_for(stream.get(), 30), BaseException)
        ran = []
        loop.fail(error)
        late = loop.submit(lambda e: ran.append(e))     # behind the failure in the queue: never runs
        ends = []
        for stream in streams:
            item = await asyncio.wait_for(stream.get(), 10)
            while not isinstance(item, BaseException):
                assert not item.finished, "a request ran to its end after the failure"
                item = await asyncio.wait_for(stream.get(), 10)
            ends.append(item)
        assert ends == [error, error]
        with pytest.raises(EngineStopped):
            await asyncio.wait_for(asyncio.wrap_future(late), 10)
        assert not ran
        started = time.monotonic()
        with pytest.raises(EngineStopped):
            await asyncio.wait_for(loop.call(lambda e: e.kv.pages_in_use()), 1)
        assert time.monotonic() - started < 0.5

    asyncio.run(scenario())
    loop._thread.join(10)
    assert not loop.alive and not loop._thread.is_alive()
    assert not engine.requests and engine.kv.pages_in_use() == 0
    loop.shutdown()        # a failed loop shuts down without blocking


def test_a_failure_ends_the_streams_even_while_the_loop_is_stuck(tiny_target, tmp_path):
    """A rank that dies mid-collective leaves the loop thread blocked in it (NCCL waits for its timeout): the
    streams must end at ``fail`` all the same, and the pages go back once the loop thread moves again. The stuck
    collective is faked by a command that waits on an event: a dead rank cannot be made to hang here on demand."""
    import threading

    drafter = checkpoints.write_tiny_drafter(tmp_path)
    engine = build_engine(EngineConfig(model=str(tiny_target), draft=str(drafter), num_pages=64))
    loop = EngineLoop(engine)
    error = EngineStopped("lost a rank")
    stuck, release = threading.Event(), threading.Event()

    async def scenario():
        stream = loop.open_stream("a")
        await loop.call(lambda e: e.add_request(PROMPTS[0], SamplingParams(max_tokens=300, ignore_eos=True),
                                                request_id="a"))
        assert not isinstance(await asyncio.wait_for(stream.get(), 30), BaseException)
        loop.submit(lambda e: (stuck.set(), release.wait(30)))
        assert await asyncio.to_thread(stuck.wait, 10)
        loop.fail(error)
        item = await asyncio.wait_for(stream.get(), 1)
        while not isinstance(item, BaseException):
            item = await asyncio.wait_for(stream.get(), 1)
        assert item is error
        started = time.monotonic()
        with pytest.raises(EngineStopped):          # refused at once, not queued behind the stuck command
            await asyncio.wait_for(loop.call(lambda e: None), 1)
        assert time.monotonic() - started < 0.5
        assert "a" in engine.requests             # the stuck thread has not freed anything yet

    asyncio.run(scenario())
    release.set()
    loop._thread.join(10)
    assert not loop._thread.is_alive() and not engine.requests and engine.kv.pages_in_use() == 0


def test_on_finish_runs_on_the_loop_thread_as_the_finished_output_is_handed_over(loop):
    """A stream opened with ``on_finish`` gets its finished output as ``(output, on_finish(engine, output))``,
    computed on the loop thread while the request's pages are still its own; an error in it reaches the stream
    instead; partial outputs pass as they are."""
    import threading

    short = SamplingParams(max_tokens=3, ignore_eos=True)

    async def run(request_id: str, on_finish) -> list:
        q = loop.open_stream(request_id, on_finish=on_finish)
        await loop.call(lambda e: e.add_request(PROMPTS[0][:20], short, request_id=request_id, hold_pages=True))
        items = [await asyncio.wait_for(q.get(), 10)]
        while not isinstance(items[-1], (tuple, BaseException)):
            assert not items[-1].finished, "the finished output came without on_finish's result"
            items.append(await asyncio.wait_for(q.get(), 10))
        loop.close_stream(request_id)
        await loop.call(lambda e: e.release(request_id) if request_id in e.requests else None)
        return items

    def tables(engine, out):
        assert threading.current_thread().name == "engine-loop"
        return out.request_id, list(engine.kv.block_table(out.request_id, 0))

    items = asyncio.run(run("fin-a", tables))
    out, (rid, pages) = items[-1]
    assert out.finished and rid == "fin-a" and len(pages) >= 2       # 20 prompt tokens + lookahead: 2 pages
    assert all(not o.finished for o in items[:-1])

    def broken(engine, out):
        raise RuntimeError("hand-over failed")

    items = asyncio.run(run("fin-b", broken))
    assert isinstance(items[-1], RuntimeError) and "hand-over failed" in str(items[-1])
    assert pages_in_use(loop) == 0


def test_nothing_reaches_a_stream_after_it_is_closed_even_if_handed_over_before(loop):
    """A step's outputs go to the consumer's event loop as one callback; a stream closed (an abort) after that
    callback was scheduled but before it ran gets none of them, while the other streams in the batch do."""
    from engine.llm_engine import RequestOutput

    def output(request_id: str) -> RequestOutput:
        return RequestOutput(request_id=request_id, prompt_token_ids=[1], token_ids=[2], text="", finished=False,
                             finish_reason=None, new_token_ids=[2], text_delta="")

    async def run():
        kept, dropped = loop.open_stream("race-kept"), loop.open_stream("race-dropped")
        # As the loop thread does after a step; the event loop cannot run the callback before the next await.
        loop.deliver([("race-kept", output("race-kept")), ("race-dropped", output("race-dropped"))])
        loop.close_stream("race-dropped")
        await asyncio.sleep(0.05)
        loop.close_stream("race-kept")
        return kept.qsize(), dropped.qsize()

    assert asyncio.run(run()) == (1, 0)


def test_the_loop_counts_its_steps_by_kind_and_its_idle_time(loop):
    """``LoopStats``: a request's 20-token prompt is computed in one prompt step, its tokens in decode steps, each
    step's wall and CPU time adds up (CPU within wall), and time with nothing to run counts as idle, not as
    steps."""
    short = SamplingParams(max_tokens=6, ignore_eos=True)

    def snapshot():
        return loop.submit(lambda e: loop.stats.snapshot()).result(timeout=10)

    async def run(request_id: str) -> int:
        q = loop.open_stream(request_id)
        await loop.call(lambda e: e.add_request(PROMPTS[1][:20], short, request_id=request_id))
        outputs = 0
        while True:
            out = await asyncio.wait_for(q.get(), 10)
            outputs += 1
            if out.finished:
                return outputs

    before = snapshot()
    outputs = asyncio.run(run("stats-a"))
    time.sleep(0.3)         # idle: no request
    after = snapshot()
    steps = {k: after["steps"][k] - before["steps"][k] for k in ("prompt", "decode")}
    assert steps["prompt"] == 1                          # 20 prompt tokens: one step computes them
    assert steps["decode"] >= 1 and steps["prompt"] + steps["decode"] >= outputs
    wall = {k: after["step_s"][k] - before["step_s"][k] for k in steps}
    cpu = {k: after["step_cpu_s"][k] - before["step_cpu_s"][k] for k in steps}
    assert all(wall[k] > 0 and 0 < cpu[k] <= wall[k] + 1e-3 for k in steps), (wall, cpu)
    idle = after["idle_s"] - before["idle_s"]
    elapsed = after["uptime_s"] - before["uptime_s"]
    assert 0.25 <= idle <= elapsed - sum(wall.values())
    assert after["thread_cpu_s"] >= before["thread_cpu_s"] + sum(cpu.values()) - 1e-3
    assert after["process_cpu_s"] >= after["thread_cpu_s"] - before["thread_cpu_s"]
