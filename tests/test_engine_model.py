"""The target model and step loop against Hugging Face transformers on tiny random checkpoints."""

import json

import pytest
import torch

from engine import LLM, SamplingParams
from engine.checkpoint import CheckpointError
from engine.model import Qwen3Model
from engine.model_runner import ModelRunner, Row
from kv import KVCacheManager, KVPool, LayerOwner, make_layer_specs

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], list(range(10, 47)), [5] * 17, [100]]


def hf_model(path):
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


def make_runner(path, page_size, num_pages=64, dtype=torch.float32):
    model = Qwen3Model.from_pretrained(path)
    c = model.config
    pool = KVPool(make_layer_specs(LayerOwner.TARGET, c.num_hidden_layers, dtype, c.num_key_value_heads,
                                   c.head_dim), page_size, num_pages)
    kv = KVCacheManager([pool], enable_prefix_caching=False)
    return ModelRunner(model, kv, "torch"), kv


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("fixture", ["tiny_target", "tiny_target_tied"])
def test_logits_match_transformers_prefill_and_decode(fixture, request):
    path = request.getfixturevalue(fixture)
    hf = hf_model(path)
    runner, kv = make_runner(path, page_size=4)
    seqs = [list(p) for p in PROMPTS]
    rows, ids = [], []
    for i, s in enumerate(seqs):
        kv.allocate_slots(f"r{i}", len(s) + 6)
        rows.append(Row(f"r{i}", 0, len(s)))
        ids.extend(s)
    # Prefill: every position of the ragged batch, in one forward.
    logits, _ = runner.run(rows, torch.tensor(ids), list(range(len(ids))))
    flat = 0
    for s in seqs:
        ref = hf(torch.tensor([s])).logits[0]
        assert rel_err(logits[flat:flat + len(s)], ref) < 1e-4
        flat += len(s)
    # Decode, token by token, all sequences batched.
    for _ in range(5):
        rows = [Row(f"r{i}", len(s), 1) for i, s in enumerate(seqs)]
        nxt = [(7 * len(s) + i) % 128 for i, s in enumerate(seqs)]
        logits, _ = runner.run(rows, torch.tensor(nxt), list(range(len(seqs))))
        for i, s in enumerate(seqs):
            s.append(nxt[i])
            ref = hf(torch.tensor([s])).logits[0, -1]
            assert rel_err(logits[i], ref) < 1e-4


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_greedy_generation_matches_transformers(tiny_target, page_size):
    hf = hf_model(tiny_target)
    # A small token budget forces chunked prefill mixed with decode rows; lengths cross page boundaries.
    llm = LLM(tiny_target, page_size=page_size, max_num_batched_tokens=24, num_pages=256 // page_size + 8)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=20, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 20)
        assert out.finish_reason == "length"
    assert llm.engine.kv.pages_in_use() == 0


def test_preemption_by_recompute_keeps_output(tiny_target):
    hf = hf_model(tiny_target)
    # 12 pages of 4 tokens cannot hold five growing sequences at once: the scheduler must preempt.
    llm = LLM(tiny_target, page_size=4, num_pages=14, max_num_batched_tokens=64, enable_prefix_caching=False)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6, 5], [3, 5, 8, 9, 7], [9, 3, 2, 3], [8, 4, 6, 2, 6]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 16)
    assert llm.engine.kv.pages_in_use() == 0


def test_preemption_happens_under_pressure(tiny_target):
    llm = LLM(tiny_target, page_size=4, num_pages=14, max_num_batched_tokens=64, enable_prefix_caching=False)
    engine = llm.engine
    reqs = [engine.add_request([i + 1] * 5, SamplingParams(max_tokens=16, ignore_eos=True)) for i in range(5)]
    while engine.has_unfinished():
        engine.step()
    assert sum(r.num_preemptions for r in reqs) > 0


def test_fp8_kv_cache_close_to_bf16(tiny_target):
    runner_bf16, kv_bf16 = make_runner(tiny_target, 16, dtype=torch.bfloat16)
    runner_fp8, kv_fp8 = make_runner(tiny_target, 16, dtype=torch.float8_e4m3fn)
    ids = list(range(3, 60))
    for kv in (kv_bf16, kv_fp8):
        kv.allocate_slots("a", len(ids))
    a, _ = runner_bf16.run([Row("a", 0, len(ids))], torch.tensor(ids), list(range(len(ids))))
    b, _ = runner_fp8.run([Row("a", 0, len(ids))], torch.tensor(ids), list(range(len(ids))))
    # e4m3 keeps 3 mantissa bits (relative rounding error <= 6.25% per element); after attention
    # averaging and two layers the logits stay within 10% relative error of the BF16 cache.
    err = rel_err(b, a)
    assert 0 < err < 0.10
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9


def test_bad_model_dirs_are_clear_errors(tmp_path, tiny_target):
    with pytest.raises(CheckpointError, match="does not exist"):
        LLM(tmp_path / "nope")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="malformed JSON"):
        LLM(bad)
    missing = tmp_path / "missing"
    missing.mkdir()
    config = json.loads((tiny_target / "config.json").read_text())
    (missing / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="no safetensors"):
        LLM(missing)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tiny_target / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(missing / "model.safetensors"))
    with pytest.raises(CheckpointError, match="model.layers.1.mlp.down_proj.weight"):
        LLM(missing)
    config.pop("hidden_size")
    (missing / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="hidden_size"):
        LLM(missing)


def test_bad_requests_change_nothing(tiny_target):
    llm = LLM(tiny_target, page_size=4, num_pages=12, max_model_len=64)
    engine = llm.engine
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
    with pytest.raises(ValueError, match="the context holds 64"):
        engine.add_request(list(range(64)), SamplingParams())
    with pytest.raises(ValueError, match="KV pages"):
        engine.add_request([1, 2], SamplingParams(max_tokens=200))
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request([1, 999], SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], SamplingParams())
    assert not engine.has_unfinished() and engine.kv.pages_in_use() == 0 and not engine.requests
    # A batch with one bad prompt queues none of them.
    with pytest.raises(ValueError):
        llm.generate([[1, 2, 3], list(range(70))])
    assert not engine.has_unfinished() and engine.kv.pages_in_use() == 0


def test_abort_frees_pages(tiny_target):
    llm = LLM(tiny_target, page_size=4, num_pages=32)
    engine = llm.engine
    a = engine.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request([6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()
    assert engine.kv.pages_in_use() > 0
    engine.abort(a.request_id)
    assert a.finish_reason == "abort"
    while engine.has_unfinished():
        engine.step()
    assert engine.kv.pages_in_use() == 0


def test_prefix_reuse_keeps_output(tiny_target):
    llm = LLM(tiny_target, page_size=4, num_pages=64)
    shared = list(range(20, 41))
    first = llm.generate([shared + [1, 2]], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    second = llm.generate([shared + [3]], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 20          # five full pages of the shared 21 tokens
    hf = hf_model(tiny_target)
    assert second.token_ids == hf_greedy(hf, shared + [3], 8)
    assert llm.engine.kv.pages_in_use() == 0


def test_a_request_that_ends_leaves_its_last_pages_to_the_prefix_cache(tiny_target):
    """The pages a request fills in its last step go to the prefix cache like the others: one that ends in its
    prompt step (max_tokens 1) leaves its whole prompt, and an answer's last page serves the next turn."""
    llm = LLM(tiny_target, page_size=4, num_pages=64)
    prompt = list(range(20, 33))                                  # 13 tokens: three full pages
    one = llm.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))[0]
    again = llm.generate([prompt + [5]], SamplingParams(max_tokens=7, ignore_eos=True))[0]
    assert one.num_cached_tokens == 0 and again.num_cached_tokens == 12
    # 14 + 7 tokens: K/V of 20 positions (not the last token's), five full pages; the fifth filled in the last step.
    turn = prompt + [5] + again.token_ids
    nxt = llm.generate([turn + [7]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(turn) == 21 and nxt.num_cached_tokens == 20
    hf = hf_model(tiny_target)
    assert again.token_ids == hf_greedy(hf, prompt + [5], 7) and nxt.token_ids == hf_greedy(hf, turn + [7], 4)
    assert llm.engine.kv.pages_in_use() == 0
