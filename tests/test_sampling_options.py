"""OpenAI sampling options in the engine, target-only and speculative: logprobs, stop tokens, min_tokens, logit
bias and penalties, each against an independent greedy loop over the Hugging Face model."""

import json

import pytest
import torch

from engine import LLM as TargetLLM
from engine import SamplingParams
from engine.llm_engine import Proposal
from engine.sampler import LogitsBlock, LogitsState, adjust_logits
from engine.sequence import TokenLogprob
from spec_decode import LLM
from tests import checkpoints

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], list(range(10, 30)), [5] * 12]
K = 3                                   # drafts per block (block size 4)


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    return checkpoints.write_tiny_drafter(tmp_path_factory.mktemp("drafter"), num_layers=2, block_size=K + 1)


@pytest.fixture(scope="module")
def hf(tiny_target):
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def plain(tiny_target):
    return TargetLLM(tiny_target, page_size=4)


@pytest.fixture(scope="module")
def spec(tiny_target, drafter_dir):
    return LLM(tiny_target, draft=drafter_dir, page_size=4)


@torch.no_grad()
def reference(hf, prompt, params, eos_ids=()):
    """Greedy decoding with the options applied by hand to the HF model's logits, one whole forward per token."""
    out = []
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
    while len(out) < params.max_tokens:
        x = hf(torch.tensor([prompt + out])).logits[0, -1].float().clone()
        for t, b in params.logit_bias:
            x[t] += b
        if len(out) < params.min_tokens:
            for t in stops:
                x[t] = float("-inf")
        for t in set(prompt) | set(out):
            x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
        for t in set(out):
            x[t] -= params.frequency_penalty * out.count(t) + params.presence_penalty
        out.append(int(x.argmax()))
        if out[-1] in stops and len(out) >= params.min_tokens:
            break
    return out


class Oracle:
    """Proposes ``truth``'s continuation (every third block with one draft corrupted), so verification accepts
    whole blocks, partial ones and none; the real drafter still runs (its K/V are written)."""

    def __init__(self, speculator, truth):
        self.inner = speculator.propose
        self.truth = truth
        self.calls = 0

    def __call__(self, rows):
        out = []
        for row, proposal in zip(rows, self.inner(rows)):
            done = len(row.request.output_token_ids)
            tokens = list(self.truth[tuple(row.request.prompt_token_ids)][done:done + proposal.num_drafts])
            tokens += [0] * (proposal.num_drafts - len(tokens))
            self.calls += 1
            if self.calls % 3 == 0:
                k = self.calls % len(tokens)
                tokens[k] = (tokens[k] + 1) % 100
            out.append(Proposal(torch.tensor(tokens)))
        return out


def generate_with_oracle(llm, prompts, params, truth, monkeypatch):
    monkeypatch.setattr(llm.engine.speculator, "propose", Oracle(llm.engine.speculator, truth))
    outs = llm.generate(prompts, params)
    monkeypatch.undo()
    return outs


# --- validation ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("logprobs", 21), ("logprobs", -1), ("logprobs", 1.5), ("min_tokens", -1), ("stop_token_ids", (3, -2)),
    ("stop_token_ids", 7), ("logit_bias", {3: 100.5}), ("logit_bias", {-1: 1.0}), ("logit_bias", {"a": 1.0}),
    ("logit_bias", [1, 2]), ("logit_bias", {1: "x"}), ("presence_penalty", 2.5), ("presence_penalty", "1"),
    ("frequency_penalty", -2.01), ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("repetition_penalty", float("nan")),
])
def test_bad_values_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_seeds_that_differ_only_above_32_bits_draw_differently(plain):
    """A CPU generator takes the low 32 bits of its seed: the request's 64 are mixed into them first, so seeds 2^32
    apart (and choice j of an n > 1 request, seeded seed + j) do not repeat each other. The same seed still
    repeats."""
    params = [SamplingParams(max_tokens=24, temperature=1.0, seed=s, ignore_eos=True)
              for s in (12345, 12345 + 2 ** 32, 12345 - 2 ** 32, 12345)]
    outs = [plain.generate([PROMPTS[2]], p)[0].token_ids for p in params]
    assert outs[0] == outs[3]
    assert len({tuple(o) for o in outs[:3]}) == 3, outs


def test_params_stay_frozen_and_hashable():
    a = SamplingParams(logit_bias={5: 1.0, 2: -3}, stop_token_ids=[4, 1], logprobs=0)
    b = SamplingParams(logit_bias=[(2, -3.0), (5, 1)], stop_token_ids=(4, 1), logprobs=0)
    assert a == b and hash(a) == hash(b) and a.logit_bias == ((2, -3.0), (5, 1.0))
    with pytest.raises(AttributeError):
        a.min_tokens = 3


def test_token_ids_outside_the_vocabulary_are_refused(plain):
    for field, value in (("stop_token_ids", (3, 128)), ("logit_bias", {128: 1.0})):
        with pytest.raises(ValueError, match=field):
            plain.engine.add_request([1, 2], SamplingParams(**{field: value}))
    assert not plain.engine.requests


# --- penalties and bias: target-only, speculative, and the reference agree ---------------------------------

CASES = {
    "frequency": dict(frequency_penalty=1.5),
    "presence": dict(presence_penalty=2.0),
    "repetition": dict(repetition_penalty=2.0),
    "bias": dict(logit_bias={7: 2.5, 11: 2.0, 30: -4.0, 50: 3.0}),
    "all": dict(frequency_penalty=0.7, presence_penalty=-0.5, repetition_penalty=1.3, logit_bias={7: 2.0, 50: 1.5}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_penalties_and_bias_match_the_reference_with_and_without_drafter(case, hf, plain, spec, monkeypatch):
    params = SamplingParams(max_tokens=20, ignore_eos=True, **CASES[case])
    truth = {tuple(p): reference(hf, p, params) for p in PROMPTS}
    unpenalised = plain.generate(PROMPTS, SamplingParams(max_tokens=20, ignore_eos=True))
    assert any(o.token_ids != truth[tuple(p)] for p, o in zip(PROMPTS, unpenalised))     # the option matters
    assert [o.token_ids for o in plain.generate(PROMPTS, params)] == [truth[tuple(p)] for p in PROMPTS]
    assert [o.token_ids for o in spec.generate(PROMPTS, params)] == [truth[tuple(p)] for p in PROMPTS]
    # Whole blocks accepted: verify row k must count the k drafts before it.
    outs = generate_with_oracle(spec, PROMPTS, params, truth, monkeypatch)
    assert [o.token_ids for o in outs] == [truth[tuple(p)] for p in PROMPTS]
    assert max(al for o in outs for al in o.acceptance_lengths) == K + 1
    assert spec.engine.kv.pages_in_use() == 0


def test_penalties_survive_preemption_and_mixed_batches(tiny_target, hf):
    """Preempted requests recompute their history without recounting it; plain and penalised requests share
    steps without one's adjustments reaching the other."""
    llm = TargetLLM(tiny_target, page_size=4, num_pages=14, max_num_batched_tokens=64, enable_prefix_caching=False)
    engine = llm.engine
    penalised = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=1, **CASES["all"])
    free = SamplingParams(max_tokens=16, ignore_eos=True)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6, 5], [3, 5, 8, 9, 7], [9, 3, 2, 3], [8, 4, 6, 2, 6]]
    reqs = [engine.add_request(p, penalised if i % 2 == 0 else free) for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
    assert sum(r.num_preemptions for r in reqs) > 0
    for i, (p, r) in enumerate(zip(prompts, reqs)):
        assert r.output_token_ids == reference(hf, p, penalised if i % 2 == 0 else free)


def test_penalty_counts_inside_a_block_are_per_position():
    """Row k of a verification block counts the output plus drafts[:k]; the drafter's rows count the output only."""
    params = SamplingParams(frequency_penalty=1.0, presence_penalty=0.5, logit_bias={2: 1.0})
    state = LogitsState(params, [0], vocab_size=6, eos_token_ids=(), device=torch.device("cpu"))
    state.add([3, 3])
    logits = torch.zeros(5, 6)
    got = adjust_logits(logits, [LogitsBlock(state, 1, 3, num_output=2, drafts=torch.tensor([4, 3]))])
    want = torch.zeros(5, 6)
    want[1:4, 2] = 1.0
    want[1:4, 3] = -2.5                 # two 3s in the output
    want[2:4, 4] = -1.5                 # draft 0 (a 4) counts from row 1 on
    want[3, 3] = -3.5                   # draft 1 (a 3) from row 2 on
    assert torch.equal(got, want)
    drafter_rows = adjust_logits(logits, [LogitsBlock(state, 0, 3, num_output=2)])
    assert torch.equal(drafter_rows[:3], want[1:2].expand(3, 6))


def test_bias_also_shapes_the_drafts(plain, spec):
    """A +100 bias makes the target emit one token forever; drafting under the same bias accepts whole blocks."""
    params = SamplingParams(max_tokens=16, ignore_eos=True, logit_bias={42: 100.0})
    for o in plain.generate(PROMPTS, params) + spec.generate(PROMPTS, params):
        assert o.token_ids == [42] * 16
    outs = spec.generate(PROMPTS, params)
    assert min(al for o in outs for al in o.acceptance_lengths[:-1]) == K + 1


def test_plain_requests_skip_the_adjustment(spec, monkeypatch):
    import engine.llm_engine
    import spec_decode.dflash

    def fail(*args):
        raise AssertionError("adjust_logits ran for a plain request")
    monkeypatch.setattr(engine.llm_engine, "adjust_logits", fail)
    monkeypatch.setattr(spec_decode.dflash, "adjust_logits", fail)
    # min_tokens with nothing to mask (EOS ignored, no stop tokens) changes no logit either.
    spec.generate(PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True, min_tokens=4, logprobs=2))
    spec.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.8, seed=1))


# --- stop tokens, min_tokens, ignore_eos ------------------------------------------------------------------

def first_new_token(tokens, start=2):
    """An index j >= start where tokens[j] occurs for the first time."""
    return next(j for j in range(start, len(tokens)) if tokens[j] not in tokens[:j])


def test_stop_token_ids_and_min_tokens(hf, plain, spec, monkeypatch):
    prompt = PROMPTS[0]
    free = plain.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True))[0].token_ids
    j = first_new_token(free)
    assert 2 <= j <= K + 1              # inside the first drafted block, at a row k >= 1
    stop = free[j]
    for llm in (plain, spec):
        out = llm.generate([prompt], SamplingParams(max_tokens=24, stop_token_ids=(stop,)))[0]
        assert out.token_ids == free[:j + 1] and out.finish_reason == "stop"
        # min_tokens = j: the stop token is allowed exactly at index j.
        out = llm.generate([prompt], SamplingParams(max_tokens=24, stop_token_ids=(stop,), min_tokens=j))[0]
        assert out.token_ids == free[:j + 1] and out.finish_reason == "stop"
    # Drafted at row j - 1 of the first block, after j output tokens: allowed there.
    out = generate_with_oracle(spec, [prompt], SamplingParams(max_tokens=24, stop_token_ids=(stop,), min_tokens=j),
                               {tuple(prompt): free}, monkeypatch)[0]
    assert out.token_ids == free[:j + 1] and len(out.acceptance_lengths) == 1      # one block
    masked = SamplingParams(max_tokens=24, stop_token_ids=(stop,), min_tokens=j + 1)
    truth = reference(hf, prompt, masked)
    assert stop not in truth[:j + 1] and truth[:j] == free[:j]
    for outs in (plain.generate([prompt], masked), spec.generate([prompt], masked),
                 generate_with_oracle(spec, [prompt], masked, {tuple(prompt): free}, monkeypatch)):
        assert outs[0].token_ids == truth


def test_min_tokens_masks_eos_and_ignore_eos_keeps_going(tiny_target, drafter_dir, hf, plain, tmp_path,
                                                         monkeypatch):
    prompt = PROMPTS[1]
    free = plain.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True))[0].token_ids
    j = first_new_token(free)
    eos = free[j]
    copy = tmp_path / "eos"
    copy.mkdir()
    (copy / "model.safetensors").symlink_to(tiny_target / "model.safetensors")
    config = json.loads((tiny_target / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "eos_token_id": eos}))
    eos_plain, eos_spec = TargetLLM(copy, page_size=4), LLM(copy, draft=drafter_dir, page_size=4)
    truth = {tuple(prompt): free}
    for llm in (eos_plain, eos_spec):
        assert llm.generate([prompt], SamplingParams(max_tokens=24))[0].token_ids == free[:j + 1]
        assert llm.generate([prompt], SamplingParams(max_tokens=24, min_tokens=j))[0].token_ids == free[:j + 1]
        kept = llm.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True))[0]
        assert kept.token_ids == free and kept.finish_reason == "length"
    # ignore_eos with whole blocks accepted across the EOS.
    kept = generate_with_oracle(eos_spec, [prompt], SamplingParams(max_tokens=24, ignore_eos=True), truth,
                                monkeypatch)[0]
    assert kept.token_ids == free and max(kept.acceptance_lengths) == K + 1
    stopped = generate_with_oracle(eos_spec, [prompt], SamplingParams(max_tokens=24, min_tokens=j), truth,
                                   monkeypatch)[0]
    assert stopped.token_ids == free[:j + 1] and len(stopped.acceptance_lengths) == 1
    masked = SamplingParams(max_tokens=24, min_tokens=j + 1)
    want = reference(hf, prompt, masked, eos_ids=(eos,))
    assert eos not in want[:j + 1]
    assert eos_plain.generate([prompt], masked)[0].token_ids == want
    assert eos_spec.generate([prompt], masked)[0].token_ids == want
    assert generate_with_oracle(eos_spec, [prompt], masked, truth, monkeypatch)[0].token_ids == want


# --- stop strings ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def char_pair(tiny_target, drafter_dir, tmp_path_factory):
    """The tiny target with a character-level tokenizer: one token, one character."""
    from tests.test_serve_support import write_char_tokenizer

    copy = tmp_path_factory.mktemp("chars")
    for name in ("model.safetensors", "config.json"):
        (copy / name).symlink_to(tiny_target / name)
    write_char_tokenizer(copy)
    return TargetLLM(copy, page_size=4), LLM(copy, draft=drafter_dir, page_size=4)


def streamed(llm, prompt, params):
    engine = llm.engine
    r = engine.add_request(llm.encode(prompt), params)
    deltas, logprobs, out = [], [], None
    while not r.finished:
        for out in engine.step():
            deltas.append(out.text_delta)
            if out.new_logprobs is not None:
                assert [e.token_id for e in out.new_logprobs] == out.new_token_ids
                logprobs.extend(out.new_logprobs)
    assert "".join(deltas) == out.text
    assert out.logprobs is None or logprobs == out.logprobs
    return out


def test_stop_strings_include_stop_str_and_min_tokens(char_pair):
    prompt = "def f(x):\n"
    for llm in char_pair:
        free = llm.generate([prompt], SamplingParams(max_tokens=32, ignore_eos=True))[0]
        stop = free.text[4:6]
        at = free.text.index(stop)
        # The token that completes the stop (ids past the tokenizer's 100 characters decode to nothing).
        n = next(n for n in range(1, 33) if stop in llm.tokenizer.decode(free.token_ids[:n]))
        out = streamed(llm, prompt, SamplingParams(max_tokens=32, ignore_eos=True, stop=(stop,)))
        assert out.text == free.text[:at] and out.finish_reason == "stop" and out.token_ids == free.token_ids[:n]
        out = streamed(llm, prompt, SamplingParams(max_tokens=32, ignore_eos=True, stop=(stop,),
                                                   include_stop_str_in_output=True))
        assert out.text == free.text[:at + 2] and out.finish_reason == "stop"
        # min_tokens = n honours the stop, one more does not.
        out = streamed(llm, prompt, SamplingParams(max_tokens=32, ignore_eos=True, stop=(stop,), min_tokens=n))
        assert out.text == free.text[:at]
        out = streamed(llm, prompt, SamplingParams(max_tokens=32, ignore_eos=True, stop=(stop,), min_tokens=n + 1))
        later = free.text.find(stop, at + 1)
        assert out.text == (free.text if later < 0 else free.text[:later])


def test_first_text_delta_follows_min_tokens_and_include(char_pair):
    engine = char_pair[0].engine
    prompt = engine.tokenizer.encode("ab")
    token = engine.tokenizer.encode("x")[0]
    assert engine.first_text_delta(prompt, SamplingParams(stop=("x",)), token) is None
    assert engine.first_text_delta(prompt, SamplingParams(stop=("x",), min_tokens=2), token) == "x"
    # "x" may begin "xy": held back, unless a stop is never cut from the text.
    assert engine.first_text_delta(prompt, SamplingParams(stop=("xy",)), token) == ""
    assert engine.first_text_delta(prompt, SamplingParams(stop=("xy",), include_stop_str_in_output=True),
                                   token) == "x"
    assert engine.first_text_delta(prompt, SamplingParams(stop_token_ids=(token,)), token) is None


# --- logprobs ----------------------------------------------------------------------------------------------

def assert_same_logprobs(a, b, tol=1e-5):
    assert [e.token_id for e in a] == [e.token_id for e in b]
    for x, y in zip(a, b):
        assert abs(x.logprob - y.logprob) <= tol
        assert [t for t, _ in x.top] == [t for t, _ in y.top]
        assert max((abs(u - v) for (_, u), (_, v) in zip(x.top, y.top)), default=0.0) <= tol


def test_speculative_logprobs_equal_target_only(plain, spec, monkeypatch):
    params = SamplingParams(max_tokens=20, ignore_eos=True, logprobs=5)
    base = plain.generate(PROMPTS, params)
    truth = {tuple(p): o.token_ids for p, o in zip(PROMPTS, base)}
    for outs in (spec.generate(PROMPTS, params), generate_with_oracle(spec, PROMPTS, params, truth, monkeypatch)):
        for o, b in zip(outs, base):
            assert o.token_ids == b.token_ids and len(o.logprobs) == len(o.token_ids)
            assert_same_logprobs(o.logprobs, b.logprobs)
    for o in base:
        for e in o.logprobs:
            assert len(e.top) == 5 and e.top[0] == (e.token_id, e.logprob)       # greedy: the best token
            assert [v for _, v in e.top] == sorted((v for _, v in e.top), reverse=True)
    assert plain.generate(PROMPTS[:1], SamplingParams(max_tokens=3))[0].logprobs is None
    assert all(e.top == () for e in plain.generate(PROMPTS[:1], SamplingParams(max_tokens=3, logprobs=0))[0].logprobs)


@torch.no_grad()
def test_logprobs_come_from_raw_logits(hf, plain, spec, char_pair):
    """Sampled under temperature, penalties and bias, the reported logprobs are still log_softmax(model output)."""
    params = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.7, seed=3, logprobs=3,
                            repetition_penalty=1.5, frequency_penalty=0.5, logit_bias={7: 3.0})
    for llm in (plain, spec):
        for prompt in PROMPTS[:2]:
            out = llm.generate([prompt], params)[0]
            raw = hf(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1:-1].log_softmax(-1)
            want = [raw[k, t].item() for k, t in enumerate(out.token_ids)]
            assert max(abs(e.logprob - w) for e, w in zip(out.logprobs, want)) < 1e-4
            top = raw.topk(3, -1)
            assert [[t for t, _ in e.top] for e in out.logprobs] == top.indices.tolist()
    streamed(char_pair[1], "abc", params)            # deltas line up with new_token_ids and add up


def copy_pages(src_engine, src_id, dst_engine, dst_id, num_tokens):
    """Copy a prompt's pages, every layer of every pool, as a disaggregated transfer would."""
    n = -(-num_tokens // src_engine.kv.page_size)
    for space, (src_pool, dst_pool) in enumerate(zip(src_engine.kv.pools, dst_engine.kv.pools)):
        src = torch.tensor(src_engine.kv.block_table(src_id, space)[:n])
        dst = torch.tensor(dst_engine.kv.block_table(dst_id, space)[:n])
        for src_group, dst_group in zip(src_pool.groups, dst_pool.groups):
            dst_group.buffer[dst] = src_group.buffer[src]


def prefilled(tiny_target, drafter_dir, prompt, params):
    """A prefill engine that computed ``prompt`` and holds its pages (its first token drawn), and a fresh decode
    engine: ``(prefill, decode, held request, first output)``."""
    prefill = LLM(tiny_target, draft=drafter_dir, page_size=4).engine
    decode = LLM(tiny_target, draft=drafter_dir, page_size=4).engine
    held = prefill.add_request(prompt, SamplingParams(**{**params.__dict__, "max_tokens": 1}), hold_pages=True)
    first = None
    while prefill.has_unfinished():
        first = prefill.step()[-1]
    return prefill, decode, held, first


def test_disaggregated_first_token_carries_its_logprob(tiny_target, drafter_dir, spec):
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2, frequency_penalty=1.0)
    prompt = PROMPTS[2]
    whole = spec.generate([prompt], params)[0]
    prefill, decode, held, first = prefilled(tiny_target, drafter_dir, prompt, params)
    assert first.token_ids == whole.token_ids[:1] and len(first.logprobs) == 1
    assert_same_logprobs(first.logprobs, whole.logprobs[:1])
    with pytest.raises(ValueError, match="first_logprob"):
        decode.reserve_transfer(prompt, first.token_ids[0], params)
    # Reserved while the prefill runs (the service's way), the first token comes when the READ has ended; one without
    # its logprob is refused there, and its pages are freed.
    bad = decode.reserve_transfer(prompt, None, params)
    assert decode.kv.pages_in_use() > 0
    with pytest.raises(ValueError, match="first_logprob"):
        decode.finish_transfer(bad.request_id, True, first_token=first.token_ids[0])
    assert decode.kv.pages_in_use() == 0 and bad.request_id not in decode.requests
    r = decode.reserve_transfer(prompt, None, params)
    copy_pages(prefill, held.request_id, decode, r.request_id, len(prompt))
    prefill.release(held.request_id)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        decode.check_first_token(params, -1)
    out = decode.finish_transfer(r.request_id, True, first_token=first.token_ids[0], first_logprob=first.logprobs[0])
    assert out.new_token_ids == whole.token_ids[:1] and out.new_logprobs == first.logprobs
    while decode.has_unfinished():
        out = decode.step()[-1]
    # The decode side's penalties counted the first token too: the same tokens as one engine.
    assert out.token_ids == whole.token_ids
    assert_same_logprobs(out.logprobs, whole.logprobs)
    assert decode.kv.pages_in_use() == 0 and prefill.kv.pages_in_use() == 0


def test_token_logprob_is_a_small_value_object():
    e = TokenLogprob(3, -0.5, ((3, -0.5), (1, -1.2)))
    assert e == TokenLogprob(3, -0.5, ((3, -0.5), (1, -1.2))) and hash(e)


def test_a_logits_state_made_in_inference_mode_counts_tokens_outside_it():
    """Requests are added from code in and out of torch.inference_mode and their counts updated by steps of
    either kind: the state's tensors are never inference tensors (those refuse in-place updates outside it)."""
    with torch.inference_mode():
        state = LogitsState(SamplingParams(presence_penalty=0.5, max_tokens=4), [1, 2], 10, [0], torch.device("cpu"))
    state.add([1, 2, 2])
    assert not state.counts.is_inference() and state.counts.tolist() == [0, 1, 2] + [0] * 7


def test_a_seeded_request_goes_on_from_the_prefill_engines_generator(tiny_target, drafter_dir, spec):
    """The decode engine takes the prefill engine's generator state with the first token, so a seeded request's
    draws go on where the prefill's stopped: the output of one engine. A state its generator cannot take is
    refused like a bad first token, and its pages are freed."""
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.9, top_p=0.95, seed=5)
    prompt = PROMPTS[2]
    whole = spec.generate([prompt], params)[0]
    prefill, decode, held, first = prefilled(tiny_target, drafter_dir, prompt, params)
    assert first.token_ids == whole.token_ids[:1]
    state = prefill.sampler_state(held.request_id)
    assert state is not None and prefill.sampler_state("nobody") is None
    bad = decode.reserve_transfer(prompt, None, params)
    with pytest.raises(ValueError, match="sampler state"):
        decode.finish_transfer(bad.request_id, True, first_token=first.token_ids[0], sampler_state=b"\0" * 7)
    assert decode.kv.pages_in_use() == 0 and bad.request_id not in decode.requests

    def decoded(sampler_state):
        r = decode.reserve_transfer(prompt, None, params)
        copy_pages(prefill, held.request_id, decode, r.request_id, len(prompt))
        decode.finish_transfer(r.request_id, True, first_token=first.token_ids[0], sampler_state=sampler_state)
        out = None
        while decode.has_unfinished():
            out = decode.step()[-1]
        return out.token_ids

    assert decoded(state) == whole.token_ids
    assert decoded(None) != whole.token_ids       # a fresh generator repeats the prefill's draw: another output
    prefill.release(held.request_id)
    assert decode.kv.pages_in_use() == 0 and prefill.kv.pages_in_use() == 0
