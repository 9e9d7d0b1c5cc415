"""The offline API's edges: sharded checkpoints, stop conditions, sampling filters, and the CLI."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sampler import probabilities, sample

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo"


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path, tiny_target):
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(tiny_target, dtype=torch.float32)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    prompts = [[1, 2, 3, 4], [7, 7, 7, 7, 7, 7]]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    a = LLM(tiny_target).generate(prompts, params)
    b = LLM(tmp_path / "sharded").generate(prompts, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


def test_eos_stops_and_ignore_eos_continues(tiny_target, tmp_path):
    # Make the greedy continuation's third token the EOS id of a copy of the checkpoint.
    llm = LLM(tiny_target)
    free = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    config = json.loads((tiny_target / "config.json").read_text())
    copy = tmp_path / "eos"
    copy.mkdir()
    (copy / "model.safetensors").symlink_to(tiny_target / "model.safetensors")
    (copy / "config.json").write_text(json.dumps({**config, "eos_token_id": free[2]}))
    stopped = LLM(copy).generate([[1, 2, 3]], SamplingParams(max_tokens=8))[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == free[:free.index(free[2]) + 1]
    kept = LLM(copy).generate([[1, 2, 3]], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert kept.finish_reason == "length" and kept.token_ids == free


def test_stop_string_truncates_text_and_frees_pages():
    from spec_decode import LLM as SpecLLM

    llm = SpecLLM(DEMO / "target", draft=DEMO / "drafter")
    prompt = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n"
    free = llm.generate([prompt], SamplingParams(max_tokens=48, ignore_eos=True))[0]
    assert "\n" in free.text.strip("\n")
    stop = free.text.strip("\n").split("\n")[0][-3:]           # the end of the first generated line
    out = llm.generate([prompt], SamplingParams(max_tokens=48, stop=(stop,), ignore_eos=True))[0]
    assert out.finish_reason == "stop"
    assert stop not in out.text and free.text.startswith(out.text)
    assert len(out.token_ids) < len(free.token_ids)
    assert llm.engine.kv.pages_in_use() == 0


def test_top_k_and_top_p_keep_only_their_tokens():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]])
    p = probabilities(logits, SamplingParams(temperature=1.0, top_k=2))[0]
    assert (p[2:] == 0).all() and torch.isclose(p[:2].sum(), torch.tensor(1.0))
    probs = logits.softmax(-1)[0]
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.9))[0]
    kept = int((p > 0).sum())
    assert probs[:kept - 1].sum() < 0.9 <= probs[:kept].sum()     # the smallest prefix reaching top_p
    cold = probabilities(logits, SamplingParams(temperature=0.25))[0]
    assert cold[0] > probs[0]                                     # lower temperature sharpens
    g = torch.Generator().manual_seed(0)
    draws = [int(sample(logits, [SamplingParams(temperature=1.0, top_k=3, seed=1)], [g])[0]) for _ in range(300)]
    assert set(draws) <= {0, 1, 2} and len(set(draws)) == 3


def test_same_seed_same_output_different_seed_different_output(tiny_target):
    llm = LLM(tiny_target)

    def run(seed):
        return llm.generate([[5, 6, 7]], SamplingParams(max_tokens=24, temperature=1.0, seed=seed,
                                                       ignore_eos=True))[0].token_ids
    assert run(3) == run(3) != run(4)


@pytest.mark.parametrize("draft", [True, False])
def test_cli_generate_json(draft):
    cmd = [sys.executable, "-m", "serve_app.cli", "generate", "--prompt", "import os\n", "--max-tokens", "12",
           "--ignore-eos", "--json"] + ([] if draft else ["--no-draft"])
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(record["token_ids"]) == 12 and record["finish_reason"] == "length" and record["text"]
    assert ("acceptance_lengths" in record) == draft
    if draft:
        assert record["mean_acceptance_length"] == pytest.approx(
            sum(record["acceptance_lengths"]) / len(record["acceptance_lengths"]))


def test_cli_reports_bad_input_clearly(tmp_path):
    done = subprocess.run([sys.executable, "-m", "serve_app.cli", "generate", "--model", str(tmp_path / "nope"),
                           "--prompt", "x"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "does not exist" in done.stderr


@pytest.mark.parametrize("settings, message", [
    (dict(dtype="int8"), "unknown model dtype 'int8'"),
    (dict(dtype="fp8"), "the model dtype cannot be fp8"),
    (dict(kv_cache_dtype="int8"), "unknown KV cache dtype 'int8'"),
    (dict(device="foo"), "device 'foo' is not a torch device"),
    (dict(device="cuda:99"), "device 'cuda:99': "),     # no CUDA here, or not 100 devices on a GPU host
])
def test_a_bad_dtype_or_device_names_its_setting(tiny_target, settings, message):
    from engine import EngineConfig, build_engine

    with pytest.raises(ValueError, match=message):
        build_engine(EngineConfig(model=str(tiny_target), **settings))


@pytest.mark.parametrize("lines, message", [
    ('plain\n{"text": "x"}\n', "p.jsonl:2: a JSON line needs a string 'prompt'"),
    ('{"prompt": 3}\n', "p.jsonl:1: a JSON line needs a string 'prompt'"),
    ("{not json\n", "p.jsonl:1: a line starting with '{' must be JSON"),
])
def test_cli_names_the_bad_line_of_a_prompt_file(tmp_path, capsys, lines, message):
    from serve_app.cli import main

    (tmp_path / "p.jsonl").write_text(lines)
    assert main(["generate", "--prompt-file", str(tmp_path / "p.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err


def test_engine_alone_refuses_a_draft_it_cannot_load(tiny_target, tmp_path):
    """The engine loads no drafter: ``draft`` without a speculator factory is an error, never target-only."""
    from engine import EngineConfig, build_engine
    from tests import checkpoints

    draft = checkpoints.write_tiny_drafter(tmp_path / "drafter")
    with pytest.raises(ValueError, match="no speculator factory"):
        LLM(tiny_target, draft=draft)
    with pytest.raises(ValueError, match="no speculator factory"):
        build_engine(EngineConfig(model=str(tiny_target), draft=str(draft)))


def test_engine_does_not_import_spec_decode(tiny_target):
    engine_dir = Path(__file__).resolve().parents[1] / "engine"
    assert [p.name for p in engine_dir.rglob("*.py") if "spec_decode" in p.read_text()] == []
    code = ("import sys; from engine import LLM; LLM(sys.argv[1]); "
            "assert not [m for m in sys.modules if m.split('.')[0] == 'spec_decode'], 'spec_decode was imported'")
    done = subprocess.run([sys.executable, "-c", code, str(tiny_target)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_a_finished_output_says_where_its_time_went(tiny_target):
    """``RequestOutput.timing`` on the finishing output only: queue (until first scheduled), prefill (to the first
    token), decode (to the end). With one sequence at a time the second request queues for the whole first one."""
    import time

    llm = LLM(tiny_target, max_num_seqs=1)
    engine = llm.engine
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    engine.add_request([1, 2, 3, 4, 5], params, request_id="a")
    engine.add_request([6, 7, 8], params, request_id="b")
    start, outs = time.monotonic(), {}
    with torch.inference_mode():
        while engine.has_unfinished():
            for out in engine.step():
                assert (out.timing is not None) == out.finished
                if out.finished:
                    outs[out.request_id] = (out, time.monotonic())
    wall = time.monotonic() - start
    for rid, (out, _) in outs.items():
        t = out.timing
        assert t.queue_s >= 0 and t.prefill_s > 0 and t.decode_s > 0, (rid, t)
        assert t.queue_s + t.prefill_s + t.decode_s <= wall + 0.05
    a, b = outs["a"][0].timing, outs["b"][0].timing
    assert b.queue_s >= a.prefill_s + a.decode_s        # "b" was scheduled only after "a" ended
    assert a.queue_s < b.queue_s
