"""Incremental detokenization: exact against a whole decode, text deltas, and stop strings on the new tail."""

import random
from pathlib import Path

import pytest

from engine import SamplingParams
from engine.tokenizer import IncrementalDetokenizer, Tokenizer
from spec_decode import LLM
from tests.test_serve_support import write_char_tokenizer, write_tiny_pair

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo"


def stream(tok: Tokenizer, ids: list[int], skip_special_tokens: bool = True) -> str:
    """Feed ids one at a time; every emitted text is final (a prefix of the decode of the ids so far)."""
    detok, text = tok.detokenizer(skip_special_tokens), ""
    for k in range(1, len(ids) + 1):
        text += detok.step(ids[:k])
        assert tok.decode(ids[:k], skip_special_tokens).startswith(text)
    return text + detok.finish(ids)


def random_ids(rng: random.Random, vocab: int, favoured: list[int], n: int) -> list[int]:
    return [rng.choice(favoured) if favoured and rng.random() < 0.4 else rng.randrange(vocab) for _ in range(n)]


@pytest.fixture(scope="module")
def bpe():
    return Tokenizer(DEMO / "target")


@pytest.mark.parametrize("skip", [True, False])
def test_byte_level_bpe_matches_whole_decode(bpe, skip):
    # Pieces that are partial UTF-8 (decode alone to U+FFFD) and the special tokens, often.
    favoured = [i for i in range(bpe.vocab_size) if "\ufffd" in bpe.decode([i])] + [0, 1, 2, 3]
    assert len(favoured) > 50
    rng = random.Random(0)
    for _ in range(800):
        ids = random_ids(rng, bpe.vocab_size, favoured, rng.randint(1, 40))
        assert stream(bpe, ids, skip) == bpe.decode(ids, skip), ids
    assert bpe.decode([3, 3], False) == "<|im_end|><|im_end|>" and bpe.decode([3, 3]) == ""


def test_multibyte_character_is_held_until_complete(bpe):
    ids = bpe.encode("a 你好, été")
    pieces = [bpe.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces)          # some characters span tokens
    detok, emitted = bpe.detokenizer(), []
    for k in range(1, len(ids) + 1):
        emitted.append(detok.step(ids[:k]))
    assert all("\ufffd" not in e for e in emitted) and "" in emitted
    assert "".join(emitted) + detok.finish(ids) == "a 你好, été"
    # An incomplete character at the end comes out as decode gives it (U+FFFD) only at finish.
    cut = next(k for k in range(1, len(ids)) if bpe.decode(ids[:k]).endswith("\ufffd"))
    assert stream(bpe, ids[:cut]) == bpe.decode(ids[:cut])


def test_token_bytes_are_each_tokens_own_bytes(bpe):
    """Logprobs report them: a byte-level piece of a character is its byte(s), not U+FFFD's."""
    text = "x = '😀😀 你好, été"
    pieces = [bpe.token_bytes(i) for i in bpe.encode(text)]
    assert b"".join(pieces) == text.encode() and b"\xf0" in pieces
    assert bpe.token_bytes(0) == b"<|endoftext|>" and bpe.token_bytes(0, skip_special_tokens=True) == b""
    assert bpe.token_bytes(bpe.vocab_size + 5) == b""
    rng = random.Random(0)
    for _ in range(300):
        ids = random_ids(rng, bpe.vocab_size, [], rng.randint(1, 12))
        joined = b"".join(bpe.token_bytes(i, skip_special_tokens=True) for i in ids)
        assert joined.decode("utf-8", "replace") == bpe.decode(ids), ids


def test_char_level_tokenizer_matches_whole_decode(tmp_path):
    write_char_tokenizer(tmp_path)
    tok = Tokenizer(tmp_path)
    rng = random.Random(1)
    for _ in range(300):
        ids = random_ids(rng, tok.vocab_size, [0, 1, 2, 3], rng.randint(1, 30))
        assert stream(tok, ids) == tok.decode(ids)


@pytest.mark.parametrize("decoder", ["byte_fallback", "metaspace"])
def test_sentencepiece_style_tokenizers_match_whole_decode(tmp_path, decoder):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + \
        ["▁", "▁a", "a", "b", "▁the", "你", "▁你", "é", "\ufffd", "..", " "]
    hf = HFTokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, [], unk_token="<unk>", byte_fallback=True))
    hf.decoder = decoders.Metaspace() if decoder == "metaspace" else decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    hf.add_special_tokens(["<s>", "</s>"])
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer(tmp_path)
    # A run of byte tokens decodes all at once (to U+FFFD per byte unless all valid): favour UTF-8 bytes.
    favoured = [3 + b for b in "你é".encode()] + [1, 2]
    rng = random.Random(2)
    for _ in range(800):
        ids = random_ids(rng, len(pieces), favoured, rng.randint(1, 30))
        assert stream(tok, ids) == tok.decode(ids), [pieces[i] for i in ids]


# --- the engine -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    return write_tiny_pair(tmp_path_factory.mktemp("detok_pair"))


@pytest.fixture(scope="module")
def char_llm(tiny_pair):
    target, drafter = tiny_pair
    return LLM(target, draft=drafter)


def appended_output(engine, r, text: str):
    """The output after one step that appends the tokens of ``text`` at once."""
    return engine._output(r, engine._append(r, engine.tokenizer.encode(text)))


def test_multi_token_append_cuts_at_a_stop_spanning_tokens(char_llm):
    engine, tok = char_llm.engine, char_llm.tokenizer
    r = engine.add_request(tok.encode("hi"), SamplingParams(max_tokens=50, stop=("cd", "xyz")))
    first = appended_output(engine, r, "ab")
    assert (first.text, first.text_delta, first.finished) == ("ab", "", False)    # holds back 3 - 1 chars
    second = appended_output(engine, r, "kx")
    assert (second.text, second.text_delta) == ("abkx", "ab")
    # One speculative step of 6 tokens: "cd" ends at the 3rd; the tokens after it are not appended.
    third = appended_output(engine, r, "xcdefg")
    assert third.new_token_ids == tok.encode("xcd") and third.token_ids == tok.encode("abkxxcd")
    assert third.finished and third.finish_reason == "stop"
    assert third.text == "abkxx" and third.text_delta == "kxx"
    assert first.text_delta + second.text_delta + third.text_delta == third.text
    engine.requests.pop(r.request_id)


def test_earliest_stop_in_a_step_wins_and_length_flushes(char_llm):
    engine, tok = char_llm.engine, char_llm.tokenizer
    r = engine.add_request(tok.encode("hi"), SamplingParams(max_tokens=50, stop=("zzz", "q", "pq")))
    out = appended_output(engine, r, "abpqzzzq")            # "pq" begins before "q": cut at "p"
    assert out.finished and out.text == "ab" and out.text_delta == "ab" and out.token_ids == tok.encode("abpq")
    engine.requests.pop(r.request_id)
    r = engine.add_request(tok.encode("hi"), SamplingParams(max_tokens=4, stop=("zzzz",)))
    outs = [appended_output(engine, r, "ab"), appended_output(engine, r, "cdef")]
    assert outs[1].finish_reason == "length" and outs[1].text == "abcd"
    assert [o.text_delta for o in outs] == ["", "abcd"]
    engine.requests.pop(r.request_id)


def test_stop_spanning_bpe_tokens_in_one_step(bpe):
    engine = LLM(DEMO / "target").engine
    text = "def hello_world(x):\n    return x + 1\n"
    ids = bpe.encode(text)
    stop = "world(x"
    k = next(k for k in range(1, len(ids) + 1) if stop in bpe.decode(ids[:k]))
    assert stop not in bpe.decode([ids[k - 1]])                          # it spans tokens
    r = engine.add_request(bpe.encode("#"), SamplingParams(max_tokens=64, stop=(stop, "nothing")))
    out = engine._output(r, engine._append(r, ids))
    assert out.finished and out.finish_reason == "stop"
    assert out.token_ids == ids[:k] and out.text == text[:text.index(stop)] == out.text_delta


def collect(engine, prompts, params):
    """Step the engine to the end; every output of each request, in order."""
    rids = [engine.add_request(p, params).request_id for p in prompts]
    outs = {rid: [] for rid in rids}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id].append(out)
    return [outs[rid] for rid in rids]


def check_deltas(outputs, stops):
    hold = max(map(len, stops), default=1) - 1
    sent = ""
    for out in outputs:
        sent += out.text_delta
        assert out.text.startswith(sent)
        if not out.finished:
            assert len(sent) <= max(0, len(out.text) - hold)
    assert outputs[-1].finished and sent == outputs[-1].text


def no_whole_decode(self, ids):
    raise AssertionError("Tokenizer.decode in the step path")


def test_engine_streams_deltas_without_decoding_whole_text(char_llm, monkeypatch):
    engine, tok = char_llm.engine, char_llm.tokenizer
    prompts = [tok.encode(p) for p in ["def f(x):\n", "hello", "a b c d e"]]
    free = collect(engine, prompts, SamplingParams(max_tokens=40, ignore_eos=True))
    for outs in free:
        check_deltas(outs, ())
        assert outs[-1].text == tok.decode(outs[-1].token_ids)
    stops = [outs[-1].text[12:14] for outs in free]
    monkeypatch.setattr(Tokenizer, "decode", no_whole_decode)
    for (i, stop), base in zip(enumerate(stops), free):
        params = SamplingParams(max_tokens=40, stop=(stop, "\x7f\x7f\x7f"), ignore_eos=True)
        outs = collect(engine, [prompts[i]], params)[0]
        check_deltas(outs, params.stop)
        full = base[-1].text
        assert outs[-1].finish_reason == "stop" and outs[-1].text == full[:full.index(stop)]
        assert base[-1].token_ids[:len(outs[-1].token_ids)] == outs[-1].token_ids


def test_demo_pair_text_is_the_whole_decode(bpe, monkeypatch):
    """The bundled pair drafts several tokens a step: text is the whole decode, cut at the earliest stop."""
    llm = LLM(DEMO / "target", draft=DEMO / "drafter")
    prompts = [bpe.encode(p) for p in ["import os\n", "def add(a, b):\n", "# 你好\n", "class A:\n"]]
    stops = ("\n\n", "return", "self")
    windows = []
    step = IncrementalDetokenizer.step
    with monkeypatch.context() as m:
        m.setattr(Tokenizer, "decode", no_whole_decode)
        # Counted, not changed: without a stop string a request's step detokenizes its tokens in one window.
        m.setattr(IncrementalDetokenizer, "step", lambda self, ids: windows.append(len(ids)) or step(self, ids))
        free = collect(llm.engine, prompts, SamplingParams(max_tokens=32, ignore_eos=True))
        free_windows, windows[:] = len(windows), []
        stopped = collect(llm.engine, prompts, SamplingParams(max_tokens=32, stop=stops))
    assert any(len(o.new_token_ids) > 1 for outs in free + stopped for o in outs)     # speculative steps
    assert free_windows <= sum(len(outs) for outs in free) < sum(len(outs[-1].token_ids) for outs in free)
    for outs in free:
        check_deltas(outs, ())
        assert outs[-1].text == bpe.decode(outs[-1].token_ids)
    for outs in stopped:
        check_deltas(outs, stops)
        text = bpe.decode(outs[-1].token_ids)
        cut = min((text.find(s) for s in stops if s in text), default=len(text))
        assert outs[-1].text == text[:cut]
    assert sum(outs[-1].finish_reason == "stop" and outs[-1].text != bpe.decode(outs[-1].token_ids)
               for outs in stopped) >= 2


@pytest.mark.parametrize("drafter", [False, True])
def test_special_tokens_are_in_the_text_when_not_skipped(bpe, drafter):
    """``skip_special_tokens=False`` puts special tokens' text in the output (and stop strings see it); the token
    ids are the same either way. A bias forces ``<|im_end|>`` (a special token) after the prompt's own text."""
    llm = LLM(DEMO / "target", draft=DEMO / "drafter" if drafter else None)
    end = bpe.token_to_id("<|im_end|>")
    prompt = bpe.encode("def add(a, b):\n")
    base = dict(max_tokens=6, ignore_eos=True, logit_bias={end: 100.0})
    skipped, shown = (collect(llm.engine, [prompt], SamplingParams(**base, skip_special_tokens=skip))[0][-1]
                      for skip in (True, False))
    assert skipped.token_ids == shown.token_ids == [end] * 6
    assert (skipped.text, shown.text) == ("", "<|im_end|>" * 6)
    cut = collect(llm.engine, [prompt], SamplingParams(**base, skip_special_tokens=False, stop=("d|><|im",)))[0][-1]
    assert (cut.text, cut.finish_reason) == ("<|im_en", "stop")


def test_no_tokenizer_no_text(tiny_target):
    outs = collect(LLM(tiny_target).engine, [[1, 2, 3]], SamplingParams(max_tokens=5, stop=("a",), ignore_eos=True))[0]
    assert all(o.text == "" and o.text_delta == "" for o in outs) and len(outs[-1].token_ids) == 5
