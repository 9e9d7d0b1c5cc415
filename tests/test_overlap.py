"""Overlap: a batch of plain decode rows launches its next step from the device's tokens before the host reads them.

On this CPU the launched step has run by the time the host reads it, so nothing overlaps in time; what these tests
pin is the bookkeeping that makes overlap safe on a GPU: each step ahead computes the right positions from the
right tokens, a request that ends on a token the host reads late drops its extra token, the batch is read and
rescheduled when it changes, and every page comes back.
"""

import asyncio
from pathlib import Path

import pytest
import torch

from actors.engine_loop import EngineLoop
from engine import LLM, SamplingParams
from engine.llm import EngineConfig
from engine.llm_engine import use_overlap
from tests.test_sampling_options import assert_same_logprobs

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo" / "target"
PROMPTS = ["def add(a, b):\n", "class Stack:\n    def push(self, x):\n", "import os\n\n", "for i in range(10):\n"]


def _run(engine, requests, events=None):
    """Step ``engine`` through ``requests`` ({id: (ids, params)}) to the end; ``events`` maps a step number to a
    callable run before it. Returns every request's finished output and the outputs seen per id, each with the
    step that gave it."""
    added = [engine.add_request(ids, params, request_id=request_id) for request_id, (ids, params) in requests.items()]
    finished, seen, step = {}, {}, 0
    while engine.has_unfinished():
        if events and step in events:
            events[step](engine)
        for out in engine.step():
            seen.setdefault(out.request_id, []).append((step, out))
            assert out.request_id not in finished, f"{out.request_id} has an output after it finished"
            if out.finished:
                finished[out.request_id] = out
        step += 1
    engine.last_run_preemptions = sum(r.num_preemptions for r in added)
    return finished, seen


def _summary(out):
    return out.token_ids, out.text, out.finish_reason


def _same_both_ways(off, on, requests):
    """``requests`` through the synchronous engine ``off`` and the overlapped ``on``: every request's tokens, text,
    ending and per-step acceptance equal. Returns the overlapped and synchronous outputs and the steps launched
    ahead."""
    expected, _ = _run(off, requests)
    before = on.num_overlapped_steps
    got, _ = _run(on, requests)
    assert {k: (_summary(v), v.acceptance_lengths) for k, v in got.items()} == \
        {k: (_summary(v), v.acceptance_lengths) for k, v in expected.items()}
    return got, expected, on.num_overlapped_steps - before


@pytest.fixture(scope="module")
def demo_engines():
    return {mode: LLM(DEMO, overlap=mode, page_size=4, max_model_len=96).engine for mode in ("off", "on")}


def test_overlap_gives_the_synchronous_tokens_text_and_endings(demo_engines, monkeypatch):
    """Greedy and seeded rows, ends by max_tokens, the context limit, a stop token and a stop string (the last two
    are known only once the host reads the token, a step after the next one was launched): the overlapped engine's
    outputs equal the synchronous engine's, it did launch steps ahead, and no page stays in use."""
    off, on = demo_engines["off"], demo_engines["on"]
    tok = off.tokenizer
    ids = [tok.encode(p) for p in PROMPTS]
    greedy = SamplingParams(max_tokens=40, ignore_eos=True)
    free = {str(i): (p, greedy) for i, p in enumerate(ids)}
    reference, _ = _run(off, free)
    # A stop token at the 6th output of request 0, a stop string inside request 1's 10th-20th tokens' text.
    stop_token = reference["0"].token_ids[5]
    stop_text = tok.decode(reference["1"].token_ids[10:20]).strip()[:4]
    assert stop_text
    requests = {
        "0": (ids[0], SamplingParams(max_tokens=40, stop_token_ids=[stop_token], ignore_eos=True)),
        "1": (ids[1], SamplingParams(max_tokens=40, stop=[stop_text], ignore_eos=True)),
        "2": (ids[2], SamplingParams(max_tokens=7, ignore_eos=True)),
        "3": (ids[3], SamplingParams(max_tokens=200, ignore_eos=True)),     # ends at max_model_len
        "4": (ids[0], SamplingParams(max_tokens=30, temperature=0.9, top_k=20, seed=11, ignore_eos=True)),
        "5": (ids[1], SamplingParams(max_tokens=30, temperature=1.0, seed=5)),
    }
    expected, _ = _run(off, requests)
    assert expected["0"].finish_reason == "stop" and expected["0"].token_ids[-1] == stop_token
    assert expected["1"].finish_reason == "stop" and stop_text not in expected["1"].text
    assert expected["3"].finish_reason == "length" and len(ids[3]) + len(expected["3"].token_ids) == 96
    before = on.num_overlapped_steps
    computed = {}               # request -> the furthest position a forward computed
    run = on.runner.run

    def recording(rows, *args, **kwargs):
        for row in rows:
            computed[row.request_id] = max(computed.get(row.request_id, 0), row.start + row.num_tokens - 1)
        return run(rows, *args, **kwargs)

    monkeypatch.setattr(on.runner, "run", recording)
    got, seen = _run(on, requests)
    monkeypatch.undo()
    assert {k: _summary(v) for k, v in got.items()} == {k: _summary(v) for k, v in expected.items()}
    # Every request's text deltas add up to its text; every step's new tokens to its tokens.
    for request_id, outs in seen.items():
        assert "".join(o.text_delta for _, o in outs) == got[request_id].text
        assert [t for _, o in outs for t in o.new_token_ids] == got[request_id].token_ids
    # At most one position past a request's end is computed (its last token, when the host read its end a step
    # late), and none past the context: the request at the context limit never has its last token computed.
    for request_id, out in got.items():
        end = len(requests[request_id][0]) + len(out.token_ids) - 1     # the last token's position
        assert computed[request_id] in (end - 1, end), request_id
    assert computed["3"] == 94
    assert on.num_overlapped_steps - before > 30
    assert off.num_overlapped_steps == 0
    assert on.kv.pages_in_use() == 0 and not on.requests


def test_no_step_is_launched_ahead_for_rows_that_all_end(demo_engines):
    """A lone request of 10 tokens: the prefill gives the first, the decode steps the other 9, each but the first
    launched ahead of the previous one's read; none after the step that surely ends it."""
    on = demo_engines["on"]
    before = on.num_overlapped_steps
    got, _ = _run(on, {"a": (on.tokenizer.encode(PROMPTS[0]), SamplingParams(max_tokens=10, ignore_eos=True))})
    assert len(got["a"].token_ids) == 10
    assert on.num_overlapped_steps - before == 8
    assert on.kv.pages_in_use() == 0 and not on.requests


def test_the_batch_is_read_and_rescheduled_when_it_changes(demo_engines):
    """A request admitted, one aborted and one that needs its prefill while others decode ahead of the host: the
    chain breaks, the newcomer is scheduled, the aborted request gets no output after its abort, and the others'
    tokens equal their runs alone. Pages back to zero."""
    off, on = demo_engines["off"], demo_engines["on"]
    tok = off.tokenizer
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ids = [tok.encode(p) for p in PROMPTS]
    alone = {str(i): _run(off, {str(i): (p, params)})[0][str(i)].token_ids for i, p in enumerate(ids)}
    aborted_at = {}

    def add(engine):
        engine.add_request(ids[3], params, request_id="3")

    def abort(engine):
        aborted_at["2"] = len(engine.requests["2"].output_token_ids)
        engine.abort("2")

    got, seen = _run(on, {str(i): (p, params) for i, p in enumerate(ids[:3])}, events={6: add, 12: abort})
    assert set(got) == {"0", "1", "3"}
    for request_id in ("0", "1", "3"):
        assert got[request_id].token_ids == alone[request_id], request_id
    assert 0 < aborted_at["2"] < 24
    assert sum(len(o.new_token_ids) for _, o in seen["2"]) == aborted_at["2"]
    # The newcomer's prefill is scheduled in the step after the one that saw it waiting (the chain breaks).
    assert seen["3"][0][0] <= 7
    assert on.kv.pages_in_use() == 0 and not on.requests


def test_a_full_pool_ends_the_chain_and_preempts_as_the_synchronous_engine_does():
    """Pages for the step ahead run out: it is not launched, and the scheduler preempts as without overlap."""
    engines = {mode: LLM(DEMO, overlap=mode, page_size=4, num_pages=24, max_model_len=96).engine
               for mode in ("off", "on")}
    tok = engines["off"].tokenizer
    params = SamplingParams(max_tokens=36, ignore_eos=True)
    requests = {str(i): (tok.encode(p), params) for i, p in enumerate(PROMPTS)}
    results = {mode: _run(engine, requests)[0] for mode, engine in engines.items()}
    assert {k: v.token_ids for k, v in results["on"].items()} == {k: v.token_ids for k, v in results["off"].items()}
    assert engines["off"].last_run_preemptions > 0
    assert engines["on"].last_run_preemptions == engines["off"].last_run_preemptions
    assert engines["on"].num_overlapped_steps > 0
    assert all(e.kv.pages_in_use() == 0 for e in engines.values())


def test_a_step_reads_the_device_once_and_the_step_ahead_not_at_all(demo_engines, monkeypatch):
    """With overlap a step reads one launched step's tokens (``tolist``) and nothing else: the step it launches
    ahead takes its ids from the device."""
    on = demo_engines["on"]
    tok = on.tokenizer
    for i, p in enumerate(PROMPTS):
        on.add_request(tok.encode(p), SamplingParams(max_tokens=16, ignore_eos=True), request_id=f"r{i}")
    reads = []
    for name in ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    per_step, before = [], on.num_overlapped_steps
    while on.has_unfinished():
        reads.clear()
        on.step()
        per_step.append(list(reads))
    monkeypatch.undo()
    assert on.num_overlapped_steps - before >= 10
    assert all(r == ["tolist"] for r in per_step), per_step


def test_overlap_modes():
    assert use_overlap("auto", "cpu", False) is False
    assert use_overlap("auto", "cuda", False) is True
    assert use_overlap("auto", "cuda", True) is False
    assert use_overlap("on", "cpu", False) is True
    assert use_overlap("off", "cuda", False) is False
    with pytest.raises(ValueError, match="tensor-parallel"):
        use_overlap("on", "cuda", True)
    with pytest.raises(ValueError, match="overlap must be one of"):
        EngineConfig(model="m", overlap="sometimes")


def test_the_engine_loop_streams_adds_and_aborts_between_overlapped_steps(demo_engines):
    """What a replica does, on the engine loop thread between steps while a step is launched ahead: requests added
    while others decode, one aborted from its stream after a few outputs. The survivors stream the tokens of the
    synchronous engine; the aborted one's stream gets nothing after the abort; every page comes back."""
    off = demo_engines["off"]
    tok = off.tokenizer
    ids = [tok.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    alone = {str(i): _run(off, {str(i): (p, params)})[0][str(i)].token_ids for i, p in enumerate(ids)}
    engine = LLM(DEMO, overlap="on", page_size=4, max_model_len=96).engine
    loop = EngineLoop(engine)

    async def stream(request_id: str, delay_s: float, abort_after: int | None) -> list[int]:
        await asyncio.sleep(delay_s)
        queue = loop.open_stream(request_id)
        await loop.call(lambda e: e.add_request(ids[int(request_id)], params, request_id=request_id))
        tokens, outputs = [], 0
        while True:
            out = await asyncio.wait_for(queue.get(), 30)
            tokens += out.new_token_ids
            outputs += 1
            if out.finished:
                return tokens
            if outputs == abort_after:
                queued = queue.qsize()      # outputs of steps before the abort may already wait in the queue
                await asyncio.wrap_future(loop.abort(request_id))
                await asyncio.sleep(0.2)            # steps run meanwhile: nothing more may arrive
                assert queue.qsize() == queued
                return tokens

    async def scenario():
        return await asyncio.gather(stream("0", 0, None), stream("1", 0, 4), stream("2", 0.05, None),
                                    stream("3", 0.08, None))

    try:
        got = asyncio.run(scenario())
        assert got[0] == alone["0"] and got[2] == alone["2"] and got[3] == alone["3"]
        assert got[1] == alone["1"][:len(got[1])] and len(got[1]) < 32
        assert engine.num_overlapped_steps > 10
        assert loop.submit(lambda e: (e.kv.pages_in_use(), len(e.requests), e.has_unfinished())).result(10) == \
            (0, 0, False)
    finally:
        loop.shutdown()


DEMO_DRAFTER = DEMO.parent / "drafter"


def _spec_engine(mode: str, **kwargs):
    """The demo pair through the graphs' static padded inputs (what a GPU replays; drafting ahead needs them)."""
    from spec_decode import LLM as SpecLLM

    engine = SpecLLM(DEMO, draft=DEMO_DRAFTER, overlap=mode, page_size=16, max_num_seqs=4, max_model_len=160,
                     **kwargs).engine
    engine.enable_cuda_graphs(capture=False)
    return engine


def test_speculative_steps_overlap_with_the_synchronous_tokens_and_acceptance():
    """The drafter's steps one ahead of the host: each next block starts past the accepted tokens the host has not
    read, its anchor the bonus token and its context the accepted positions' hidden states, stored by the drafter
    graph. Ends by max_tokens, the context limit, a stop token and a stop string. Tokens, text, endings and every
    step's acceptance equal the synchronous engine's; no context is left pending and no page in use."""
    engines = {mode: _spec_engine(mode) for mode in ("off", "on")}
    tok = engines["off"].tokenizer
    ids = [tok.encode(p) for p in PROMPTS]
    free, _ = _run(engines["off"], {"0": (ids[0], SamplingParams(max_tokens=40, ignore_eos=True))})
    stop_token = free["0"].token_ids[12]
    requests = {
        "0": (ids[0], SamplingParams(max_tokens=60, stop_token_ids=[stop_token], ignore_eos=True)),
        "1": (ids[1], SamplingParams(max_tokens=60, stop=["return"], ignore_eos=True)),
        "2": (ids[2], SamplingParams(max_tokens=23, ignore_eos=True)),
        "3": (ids[3], SamplingParams(max_tokens=400, ignore_eos=True)),        # ends at max_model_len
    }
    expected, _ = _run(engines["off"], requests)
    assert expected["0"].finish_reason == "stop" and expected["0"].token_ids[-1] == stop_token
    assert expected["3"].finish_reason == "length" and len(ids[3]) + len(expected["3"].token_ids) == 160
    on = engines["on"]
    # While a step runs ahead, the drafter graph stores the accepted context: nothing goes the eager way.
    eager_stores = []
    store = on.speculator.store_context

    def recording(items):
        if on._launched is not None:
            eager_stores.append([r.request_id for r, _, _ in items])
        return store(items)

    on.speculator.store_context = recording
    got, seen = _run(on, requests)
    assert eager_stores == []

    def summary(outs):
        return {k: (_summary(v), v.acceptance_lengths) for k, v in outs.items()}

    assert summary(got) == summary(expected)
    assert max(al for out in got.values() for al in out.acceptance_lengths) > 3        # drafts were accepted
    for request_id, outs in seen.items():
        assert "".join(o.text_delta for _, o in outs) == got[request_id].text
    assert on.num_overlapped_steps > 10 and engines["off"].num_overlapped_steps == 0
    assert not on.speculator._pending and on.kv.pages_in_use() == 0 and not on.requests


def test_sampled_speculative_rows_run_ahead_and_draw_what_the_synchronous_engine_draws():
    """Seeded sampled rows (temperature, top-k, top-p) beside greedy ones, and a batch of sampled rows alone: their
    steps run ahead of the host (drafts drawn and rejection-sampled on the device), and every request's tokens and
    every step's acceptance equal the synchronous engine's, which draws from each seeded request's generator in the
    same order. Pages back to zero."""
    engines = {mode: _spec_engine(mode) for mode in ("off", "on")}
    tok = engines["off"].tokenizer
    ids = [tok.encode(p) for p in PROMPTS]
    mixed = {
        "g": (ids[0], SamplingParams(max_tokens=40, ignore_eos=True)),
        "s1": (ids[1], SamplingParams(max_tokens=44, temperature=0.7, seed=7, ignore_eos=True)),
        "s2": (ids[2], SamplingParams(max_tokens=36, temperature=1.0, top_k=30, top_p=0.9, seed=123,
                                      ignore_eos=True)),
        "g2": (ids[3], SamplingParams(max_tokens=30, ignore_eos=True)),
    }
    sampled_only = {"a": (ids[3], SamplingParams(max_tokens=40, temperature=0.5, seed=1, ignore_eos=True)),
                    "b": (ids[0], SamplingParams(max_tokens=40, temperature=0.9, top_p=0.8, seed=2, ignore_eos=True))}

    def summary(outs):
        return {k: (_summary(v), v.acceptance_lengths) for k, v in outs.items()}

    for requests in (mixed, sampled_only):
        expected, _ = _run(engines["off"], requests)
        before = engines["on"].num_overlapped_steps
        got, _ = _run(engines["on"], requests)
        assert summary(got) == summary(expected)
        assert engines["on"].num_overlapped_steps - before > 10
        # Drafts were accepted and rejected on the sampled rows: the rejection path ran, and not only its first draft.
        lengths = [al for k, v in got.items() if k.startswith(("s", "a", "b")) for al in v.acceptance_lengths]
        assert max(lengths) > 2 and min(lengths) == 1
    on = engines["on"]
    assert not on.speculator._pending and on.kv.pages_in_use() == 0 and not on.requests


PENALISED = [SamplingParams(max_tokens=36, presence_penalty=0.8, frequency_penalty=0.4, ignore_eos=True),
             SamplingParams(max_tokens=40, temperature=0.8, seed=9, repetition_penalty=1.3, ignore_eos=True),
             SamplingParams(max_tokens=32, logit_bias=((40, 4.0), (41, -3.0)), ignore_eos=True),
             SamplingParams(max_tokens=44, temperature=1.0, top_p=0.9, seed=4, frequency_penalty=1.0,
                            logit_bias=((42, 2.0),), ignore_eos=True)]


@pytest.mark.parametrize("drafter", [False, True], ids=["plain", "speculative"])
def test_penalised_rows_run_ahead_with_their_counts_kept_on_the_device(drafter, demo_engines):
    """Rows with presence, frequency and repetition penalties and a logit bias, greedy and seeded sampled: their
    steps run ahead of the host, the launched step's tokens counted on the device for the next step's penalties
    (``LogitsState.count_ahead``; the host does not count them again), and every request's tokens (and every
    step's acceptance) equal the synchronous engine's. Pages back to zero."""
    off, on = (_spec_engine(m) for m in ("off", "on")) if drafter else (demo_engines["off"], demo_engines["on"])
    tok = off.tokenizer
    requests = {str(i): (tok.encode(p), params) for i, (p, params) in enumerate(zip(PROMPTS, PENALISED))}
    got, expected, ahead = _same_both_ways(off, on, requests)
    assert ahead > 10
    # The penalties bit: without them the greedy rows decode otherwise.
    plain, _ = _run(off, {k: (ids, SamplingParams(max_tokens=p.max_tokens, ignore_eos=True))
                          for k, (ids, p) in requests.items() if p.temperature == 0})
    assert all(plain[k].token_ids != expected[k].token_ids for k in plain)
    assert on.kv.pages_in_use() == 0 and not on.requests


@pytest.mark.parametrize("drafter", [False, True], ids=["plain", "speculative"])
def test_rows_with_logprobs_run_ahead_and_report_the_synchronous_entries(drafter, demo_engines):
    """Rows asking for logprobs (greedy with 3 alternatives, seeded sampled with none) beside a row that does not:
    their entries are computed on the device as each step is launched (a step launched ahead overwrites the raw
    logits they come from before the host reads them), and equal the synchronous engine's, as do the tokens and
    every step's acceptance."""
    off, on = (_spec_engine(m) for m in ("off", "on")) if drafter else (demo_engines["off"], demo_engines["on"])
    tok = off.tokenizer
    kinds = [SamplingParams(max_tokens=30, logprobs=3, ignore_eos=True),
             SamplingParams(max_tokens=36, temperature=0.8, seed=2, logprobs=0, ignore_eos=True),
             SamplingParams(max_tokens=24, ignore_eos=True)]
    requests = {str(i): (tok.encode(p), params) for i, (p, params) in enumerate(zip(PROMPTS, kinds))}
    expected, _ = _run(off, requests)
    before = on.num_overlapped_steps
    got, _ = _run(on, requests)

    def summary(outs):
        return {k: (_summary(v), v.acceptance_lengths) for k, v in outs.items()}

    assert summary(got) == summary(expected)
    for k, out in got.items():      # within float noise: a row that ended goes along in a step launched ahead, and
        if out.logprobs is not None:        # a batch of another size may round the last bit of a logit otherwise
            assert_same_logprobs(out.logprobs, expected[k].logprobs)
    assert on.num_overlapped_steps - before > 10
    assert len(got["0"].logprobs) == 30 and all(len(e.top) == 3 for e in got["0"].logprobs)
    assert got["0"].logprobs[0].token_id == got["0"].token_ids[0] and got["2"].logprobs is None
    assert on.kv.pages_in_use() == 0 and not on.requests


@pytest.mark.parametrize("drafter", [False, True], ids=["plain", "speculative"])
def test_min_tokens_rows_run_ahead_with_their_output_length_on_the_device(drafter, demo_engines):
    """Rows whose stop token is pushed up by a bias, so that every position wants it, and a min_tokens mask holds it
    off: a step launched ahead counts the launched step's tokens into the output's length on the device (the host
    has not read them), so the stop comes exactly where the synchronous engine puts it. A length one step stale
    (the host's) would hold the stop off one position (a plain row) or several (a speculative one) too long."""
    off, on = (_spec_engine(m) for m in ("off", "on")) if drafter else (demo_engines["off"], demo_engines["on"])
    tok = off.tokenizer
    stop = tok.encode(" the")[0]
    kinds = [SamplingParams(max_tokens=40, min_tokens=17, stop_token_ids=(stop,), logit_bias=((stop, 40.0),)),
             SamplingParams(max_tokens=40, min_tokens=23, temperature=0.8, seed=5, stop_token_ids=(stop,),
                            logit_bias=((stop, 40.0),)),
             SamplingParams(max_tokens=40, min_tokens=11, stop_token_ids=(stop,), logit_bias=((stop, 40.0),),
                            presence_penalty=0.5),
             SamplingParams(max_tokens=36, ignore_eos=True)]
    requests = {str(i): (tok.encode(p), params) for i, (p, params) in enumerate(zip(PROMPTS, kinds))}
    got, _, ahead = _same_both_ways(off, on, requests)
    # The mask bit: each greedy biased row stopped right at its min_tokens, on the stop token; the sampled one
    # not before.
    for k in "02":
        assert len(got[k].token_ids) == kinds[int(k)].min_tokens + 1 and got[k].token_ids[-1] == stop
        assert stop not in got[k].token_ids[:-1] and got[k].finish_reason == "stop"
    assert stop not in got["1"].token_ids[:kinds[1].min_tokens]
    assert ahead > 8
    assert on.kv.pages_in_use() == 0 and not on.requests


def test_speculative_overlap_breaks_for_newcomers_aborts_and_min_tokens_rows():
    """Requests admitted and aborted while the drafter's steps run ahead, and a sampled request with min_tokens
    joining: the batch is read and rescheduled, and every surviving greedy request's tokens equal its run alone
    (greedy speculation is lossless). Pages back to zero."""
    alone_engine = _spec_engine("off")
    tok = alone_engine.tokenizer
    ids = [tok.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    alone = {str(i): _run(alone_engine, {str(i): (p, params)})[0][str(i)].token_ids for i, p in enumerate(ids)}
    on = _spec_engine("on")
    sampled = SamplingParams(max_tokens=10, temperature=0.8, seed=3, min_tokens=5)

    def add(engine):
        engine.add_request(ids[2], params, request_id="2")

    def abort(engine):
        engine.abort("1")

    def add_sampled(engine):
        engine.add_request(ids[0], sampled, request_id="s")

    got, seen = _run(on, {"0": (ids[0], params), "1": (ids[1], params)},
                     events={3: add, 6: abort, 8: add_sampled})
    assert set(got) == {"0", "2", "s"}
    assert got["0"].token_ids == alone["0"] and got["2"].token_ids == alone["2"]
    assert 5 <= len(got["s"].token_ids) <= 10
    assert 0 < sum(len(o.new_token_ids) for _, o in seen["1"]) < 48
    assert on.num_overlapped_steps > 3
    assert not on.speculator._pending and on.kv.pages_in_use() == 0 and not on.requests


@pytest.mark.parametrize("drafter", [None, "on", "off"], ids=["plain", "speculative", "speculative-separate-pool"])
def test_a_finished_request_leaves_the_batch_ahead_without_a_synchronous_step(drafter, demo_engines, monkeypatch):
    """Four requests of 12, 20, 28 and 36 tokens admitted together: after the prefill and the first launch, every
    step is launched ahead of the previous one's read, each finished request simply leaving the batch (no
    synchronous step, no rescheduling). Tokens and every step's acceptance equal the synchronous engine's, with
    the drafter's layers in the unified pool (the drafter reuses the verification's metadata) and in a pool of
    their own (it computes its own)."""
    if drafter:
        off, on = (_spec_engine(m, shared_draft_kv=drafter) for m in ("off", "on"))
        assert on.layout.unified == (drafter == "on")
    else:
        off, on = demo_engines["off"], demo_engines["on"]
    tok = off.tokenizer
    requests = {str(i): (tok.encode(p), SamplingParams(max_tokens=12 + 8 * i, ignore_eos=True))
                for i, p in enumerate(PROMPTS)}
    expected, _ = _run(off, requests)
    forwards = []
    forward = on._forward
    monkeypatch.setattr(on, "_forward", lambda scheduled: forwards.append(len(scheduled)) or forward(scheduled))
    got, _ = _run(on, requests)

    def summary(outs):
        return {k: (v.token_ids, v.acceptance_lengths) for k, v in outs.items()}

    assert summary(got) == summary(expected)
    assert forwards == [4, 4], forwards          # the prefill, then the first decode step; the rest ran ahead
    assert on.kv.pages_in_use() == 0 and not on.requests
