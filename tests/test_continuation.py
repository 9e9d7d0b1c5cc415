"""A request continued from the output it already gave out (``engine.sequence.Continuation``): what the service
sends to another replica when the one streaming a request is lost (``serve_app.ingress.Choice``). On the demo pair
with its drafter: cut after any step, the continued request gives the rest of the uninterrupted one's tokens, text
deltas, logprobs and ending, whatever counts its earlier output (max_tokens, stop strings across the cut,
penalties, min_tokens)."""

from pathlib import Path

import pytest

from engine import SamplingParams
from engine.sequence import Continuation, TokenLogprob
from spec_decode import LLM
from tests.test_sampling_options import assert_same_logprobs

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo"
PROMPT = "def add(a, b):\n"


@pytest.fixture(scope="module")
def engine():
    return LLM(DEMO / "target", draft=DEMO / "drafter", page_size=4).engine


def run(engine, ids, params, continuation=None):
    """Every output of one request, stepped to its end."""
    rid = engine.add_request(ids, params, continuation=continuation).request_id
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    assert outs[-1].finished
    return outs


def given_out(outs) -> tuple[list[int], list[TokenLogprob], str]:
    """What a client got of these outputs: tokens, logprobs entries, text."""
    tokens = [t for o in outs for t in o.new_token_ids]
    logprobs = [e for o in outs for e in (o.new_logprobs or ())]
    return tokens, logprobs, "".join(o.text_delta for o in outs)


def uninterrupted(engine, params):
    """The request's outputs, its whole output as given out, and the text it ends with."""
    ids = engine.tokenizer.encode(PROMPT)
    outs = run(engine, ids, params)
    assert len(outs) >= 4 and any(len(o.new_token_ids) > 1 for o in outs)   # cuts to make, speculative steps
    return ids, outs, given_out(outs)


def check_every_cut(engine, params):
    ids, outs, (tokens, logprobs, text) = uninterrupted(engine, params)
    assert text == outs[-1].text
    for cut in range(1, len(outs)):
        sent_tokens, sent_logprobs, sent_text = given_out(outs[:cut])
        rest = run(engine, ids, params, Continuation(sent_tokens, sent_logprobs, len(sent_text)))
        got_tokens, got_logprobs, got_text = given_out(rest)
        assert sent_tokens + got_tokens == tokens, f"cut after step {cut}"
        assert sent_text + got_text == text, f"cut after step {cut}"
        assert rest[-1].finish_reason == outs[-1].finish_reason
        assert rest[-1].token_ids == tokens and rest[-1].text == text     # the whole output, as the lost engine's
        if params.logprobs is not None:
            assert_same_logprobs(sent_logprobs + got_logprobs, logprobs)
    assert engine.kv.pages_in_use() == 0 and not engine.requests
    return outs


def test_a_greedy_request_goes_on_as_it_would_have_from_any_step(engine):
    check_every_cut(engine, SamplingParams(max_tokens=24, ignore_eos=True, logprobs=2))


def test_penalties_count_the_output_given_out_before_the_cut(engine):
    """Presence and frequency penalties change the greedy choice with every token counted: a continued request
    that did not count its earlier output would choose otherwise."""
    params = SamplingParams(max_tokens=24, ignore_eos=True, presence_penalty=1.5, frequency_penalty=1.0)
    plain = run(engine, engine.tokenizer.encode(PROMPT), SamplingParams(max_tokens=24, ignore_eos=True))
    assert plain[-1].token_ids != check_every_cut(engine, params)[-1].token_ids    # the penalties do bite


def test_a_stop_string_across_the_cut_ends_the_request_where_it_would_have(engine):
    """The stop string is taken from the uninterrupted text so that it begins before some cuts and ends after
    them: the text held back for it (never sent) comes back from the continued request's own detokenizing."""
    free = run(engine, engine.tokenizer.encode(PROMPT), SamplingParams(max_tokens=24, ignore_eos=True))
    text = free[-1].text
    begin = len(text) * 2 // 3
    stop = text[begin:begin + 4]
    assert stop.strip() and text.find(stop) == begin, repr(text)
    outs = check_every_cut(engine, SamplingParams(max_tokens=24, ignore_eos=True, stop=(stop,)))
    assert outs[-1].finish_reason == "stop" and outs[-1].text == text[:begin]


def test_min_tokens_counts_the_output_given_out_before_the_cut(engine):
    """A stop token the free output takes first at position k, with min_tokens k: the request stops there (the
    mask has lifted). Counted from the cut instead, the mask would still hold there, and the request go on."""
    free = run(engine, engine.tokenizer.encode(PROMPT), SamplingParams(max_tokens=24, ignore_eos=True))[-1]
    k = next(k for k in range(6, len(free.token_ids)) if free.token_ids[k] not in free.token_ids[:k])
    params = SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=(free.token_ids[k],), min_tokens=k)
    outs = check_every_cut(engine, params)
    assert outs[-1].finish_reason == "stop" and outs[-1].token_ids == free.token_ids[:k + 1]


@pytest.mark.parametrize("bad,match", [
    (Continuation((5, 10**6)), "token ids"),
    (Continuation(tuple(range(8))), "max_tokens"),
    (Continuation((5, 6), num_text_sent=10**4), "text sent"),
    (Continuation((5, 6), num_text_sent=-1), "text sent"),
    (Continuation((5, 6), logprobs=(TokenLogprob(5, -0.1),)), "logprobs"),
])
def test_a_bad_continuation_is_refused_and_changes_nothing(engine, bad, match):
    ids = engine.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=8, logprobs=0 if match == "logprobs" else None)
    with pytest.raises(ValueError, match=match):
        engine.add_request(ids, params, continuation=bad)
    assert not engine.requests and not engine.has_unfinished() and engine.kv.pages_in_use() == 0


def test_a_continuation_past_the_context_is_refused():
    small = LLM(DEMO / "target", page_size=4, max_model_len=32).engine
    ids = small.tokenizer.encode(PROMPT)
    with pytest.raises(ValueError, match="context"):
        small.add_request(ids, SamplingParams(max_tokens=40), continuation=Continuation([5] * (32 - len(ids))))
    assert not small.requests
