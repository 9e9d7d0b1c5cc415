"""Tensor parallelism inside an aggregated replica: rank 0 and rank 1 Ray actors beside the replica, both
stepping in lockstep over a gloo process group. Float32 greedy output must not depend on the TP size."""

import asyncio
import json
import os
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray

import ray  # noqa: E402

from actors.offline import encode_prompts  # noqa: E402
from actors.replica import AggregatedReplica, PrefillReplica  # noqa: E402
from engine.llm import EngineConfig  # noqa: E402
from engine.sequence import SamplingParams  # noqa: E402
from serve_app.config import ConfigError, parse_service_config  # noqa: E402
from tests import checkpoints  # noqa: E402

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo"


def demo_prompts(n=3):
    lines = (DEMO.parents[1] / "benchmarks" / "prompts" / "heldout.jsonl").read_text().splitlines()
    return [json.loads(line)["prompt"] for line in lines[:n]]


def generate(replica, prompts, max_tokens=32):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    reqs = [(f"r{i}", list(p), params) for i, p in enumerate(prompts)]
    return asyncio.run(replica.generate_all(reqs))


def tokens_and_acceptance(outputs):
    return [(o.token_ids, o.acceptance_lengths) for o in outputs]


@pytest.fixture(scope="module")
def demo_ids():
    return encode_prompts(str(DEMO / "target"), demo_prompts())


@pytest.fixture(scope="module", params=["target-only", "dflash"])
def demo_pair(request, ray_cluster):
    """TP 1 and TP 2 aggregated replicas over the demo pair (4 heads, 2 kv heads), float32."""
    draft = str(DEMO / "drafter") if request.param == "dflash" else None
    config = EngineConfig(model=str(DEMO / "target"), draft=draft, num_pages=128, max_num_batched_tokens=64)
    replicas = {tp: AggregatedReplica(config, tp_size=tp) for tp in (1, 2)}
    yield replicas
    for replica in replicas.values():
        replica.shutdown()


def test_tp2_greedy_output_and_acceptance_equal_tp1(demo_pair, demo_ids):
    # A 64-token budget splits the longer prompts into prefill chunks next to decode rows.
    tp1, tp2 = (tokens_and_acceptance(generate(demo_pair[tp], demo_ids)) for tp in (1, 2))
    assert tp2 == tp1
    if demo_pair[1].config.draft is not None:
        # Acceptance that means something: the per-step comparison above would pass trivially at AL 1.
        steps = [al for _, als in tp1 for al in als]
        assert sum(steps) / len(steps) > 1.5
    assert demo_pair[2].group.pages_in_use_per_rank() == [0, 0]
    assert demo_pair[2].group.health_problems() == []


def test_a_rank_slow_to_answer_fails_a_health_check_but_does_not_stop_the_replica(demo_pair, demo_ids):
    """Only a rank that is gone stops a replica (``lost_rank``); one busy past the ping timeout fails that health
    check (Serve replaces a replica only after several in a row) and serves on."""
    replica = demo_pair[2]
    busy = replica.group.remote_ranks[0].__ray_call__.remote(lambda self: time.sleep(3))
    problems = replica.group.health_problems(timeout_s=0.5)
    assert [(p.rank, p.fatal) for p in problems] == [(1, False)], problems
    replica.lost_rank(problems)
    assert not replica.engine.failed and replica.engine.alive
    ray.get(busy)
    assert replica.group.health_problems() == []
    assert tokens_and_acceptance(generate(replica, demo_ids[:1])) == \
        tokens_and_acceptance(generate(demo_pair[1], demo_ids[:1]))


def _rank0_shapes(engine):
    """In rank 0's engine process: the shapes that say what it holds of the model and of the kv heads."""
    m, c = engine.model, engine.model.config
    return {"config": (c.vocab_size, c.hidden_size, c.intermediate_size), "embed": tuple(m.embed_tokens.shape),
            "qkv_rows": m.layers[0].qkv.shape[0], "down": tuple(m.layers[0].down.shape),
            "kv_heads": {spec.num_kv_heads for spec in engine.kv.pools[0].specs},
            "pages": [p.num_pages for p in engine.kv.pools]}


def test_each_rank_holds_its_shard_and_its_kv_heads(demo_pair):
    one, two = (ray.get(demo_pair[tp].group.host.__ray_call__.remote(lambda host: _rank0_shapes(host.engine)))
                for tp in (1, 2))
    vocab, hidden, intermediate = one["config"]
    assert two["embed"] == (vocab // 2, hidden)
    assert two["qkv_rows"] == one["qkv_rows"] // 2
    assert two["down"] == (hidden, intermediate // 2)
    # Rank 0's unified pool: 1 of the 2 kv heads per layer, target and draft layers alike, and as many pages.
    assert two["kv_heads"] == {1} and one["kv_heads"] == {2}
    assert two["pages"] == one["pages"]


def test_idle_rank_processes_use_no_cpu(demo_pair):
    """Rank 0's engine process waits for its next command, and rank 1 for rank 0's next message, in blocking reads,
    not polls. Ray's own threads in any worker process tick now and then (about 2% of a core on a loaded box):
    measured beside an idle Ray actor's process over the same window, neither may cost more than it (a poll with
    even a 1 ms sleep costs more)."""
    group = demo_pair[2].group

    @ray.remote(num_cpus=0)
    class Idle:
        def pid(self):
            return os.getpid()

    idle = Idle.remote()
    pids = [ray.get(rank.__ray_call__.remote(lambda self: os.getpid())) for rank in (group.host, *group.remote_ranks)]
    pids.append(ray.get(idle.pid.remote()))

    def cpu_seconds(pid):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    time.sleep(1)
    before, start = [cpu_seconds(pid) for pid in pids], time.monotonic()
    time.sleep(5)
    *ranks, baseline = [(cpu_seconds(pid) - b) / (time.monotonic() - start) for pid, b in zip(pids, before)]
    ray.kill(idle)
    assert len(ranks) == 2 and all(r < 0.05 and r - baseline < 0.01 for r in ranks), (ranks, baseline)


def test_kv_heads_fewer_than_ranks_are_replicated(ray_cluster, tmp_path):
    """One kv head, two ranks: each rank stores that head's K/V for its own query heads (as vLLM does)."""
    target = checkpoints.write_tiny_qwen3(tmp_path / "target", num_key_value_heads=1)
    drafter = checkpoints.write_tiny_drafter(tmp_path / "drafter", num_key_value_heads=1)
    config = EngineConfig(model=str(target), draft=str(drafter), num_pages=64)
    prompts = [[(7 * i + 3 * j) % 120 + 1 for j in range(n)] for i, n in enumerate([5, 16, 33])]
    outputs = {}
    for tp in (1, 2):
        replica = AggregatedReplica(config, tp_size=tp)
        try:
            outputs[tp] = tokens_and_acceptance(generate(replica, prompts, max_tokens=16))
            assert ray.get(replica.group.host.kv_head_counts.remote())[0] == {1}
            assert replica.group.pages_in_use_per_rank() == [0] * tp
        finally:
            replica.shutdown()
    assert outputs[2] == outputs[1]


def test_a_tp_size_that_does_not_split_the_heads_is_refused_at_start(tiny_target):
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide num_attention_heads 4"):
        AggregatedReplica(EngineConfig(model=str(tiny_target)), tp_size=3)
    from serve_app.cli import main

    assert main(["generate", "--model", str(tiny_target), "--mode", "agg", "--tp", "3", "--prompt", "x"]) == 2


def test_disaggregated_tp_configs_pass_and_an_unmappable_split_is_refused_naming_it(tiny_target):
    # The heterogeneous transfer itself is pinned in tests/test_tp_disagg.py.
    service = parse_service_config({"prefill": {"tensor_parallel_size": 2}, "decode": {"tensor_parallel_size": 1}})
    assert (service.tp_size("prefill"), service.tp_size("decode")) == (2, 1)
    with pytest.raises(ConfigError, match=r"decode tensor_parallel_size 3 \(split prefill 2 -> decode 3\) cannot "
                                          "be mapped: tensor_parallel_size 3 does not divide num_attention_heads 4"):
        parse_service_config({"prefill": {"tensor_parallel_size": 2}, "decode": {"tensor_parallel_size": 3}})
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide"):
        PrefillReplica(EngineConfig(model=str(tiny_target)), tp_size=3)
    service = parse_service_config({"mode": "aggregated", "aggregated": {"tensor_parallel_size": 2}})
    assert service.tp_size("aggregated") == 2


def test_cli_generate_agg_tp2_prints_the_tp1_json(ray_cluster, capsys):
    from serve_app.cli import main

    args = ["generate", "--json", "--max-tokens", "24", "--prompt", demo_prompts(1)[0]]
    records = []
    for extra in ([], ["--mode", "agg", "--tp", "2"]):      # the in-process engine, then two Ray ranks
        assert main(args + extra) == 0
        records.append(json.loads(capsys.readouterr().out.strip()))
    assert records[1] == records[0]
    assert records[1]["mean_acceptance_length"] > 1.5 and len(records[1]["token_ids"]) == 24


def test_stream_interval_sends_a_chunk_every_k_steps_after_the_first_token(demo_pair, demo_ids):
    """``stream_interval`` k: the first token goes alone and at once (TTFT), then a request's tokens go every k
    engine steps (or more, when the consumer fell behind), the last chunk at once; the tokens are the same."""
    replica = demo_pair[1]

    async def chunks(interval, request_id):
        replica.stream_interval = interval
        try:
            return [c async for c in replica.generate(request_id, list(demo_ids[0]),
                                                      SamplingParams(max_tokens=40, ignore_eos=True))]
        finally:
            replica.stream_interval = 1

    every_step, every_third = asyncio.run(chunks(1, "k1")), asyncio.run(chunks(3, "k3"))
    tokens = [[t for c in run for t in c["token_ids"]] for run in (every_step, every_third)]
    assert tokens[0] == tokens[1] and len(tokens[0]) == 40
    carrying = [c for c in every_third if c["token_ids"]]
    assert len(carrying[0]["token_ids"]) == 1 and carrying[-1]["finished"]
    steps = len(carrying[-1]["spec"]["acceptance_lengths"]) or 39      # decode steps after the prefill's token
    assert len(carrying) <= 2 + -(-steps // 3) < len([c for c in every_step if c["token_ids"]])


def _loop_after_failure(host) -> tuple:
    """In rank 0's engine process: whether its loop failed, and what is left of its requests and pages once its
    thread has ended."""
    host.loop._thread.join(10)
    return host.loop.failed, host.loop._thread.is_alive(), len(host.engine.requests), host.engine.kv.pages_in_use()


def test_a_rank_killed_mid_step_ends_the_requests_with_a_retryable_error_and_stops_the_engine(ray_cluster, demo_ids):
    """Rank 1's process killed while rank 0 steps: rank 0's collective fails at once (gloo sees the connection
    reset). The requests in flight must end as ``unavailable`` (503, which the router sends again elsewhere), not
    as a bug (500, which it does not), later requests must be refused the same way, and rank 0's engine must stop
    computing with its pages freed: the group cannot be used again."""
    replica = AggregatedReplica(EngineConfig(model=str(DEMO / "target"), num_pages=256), tp_size=2)
    long = SamplingParams(max_tokens=1200, ignore_eos=True)

    async def scenario():
        gens = [replica.generate(f"k{i}", list(ids), long) for i, ids in enumerate(demo_ids[:2])]
        for gen in gens:
            first = await asyncio.wait_for(gen.__anext__(), 60)
            assert first["type"] == "tokens", first
        ray.kill(replica.group.remote_ranks[0])
        ends = []
        for gen in gens:
            chunks = [c async for c in gen]
            assert chunks and all(c["type"] == "tokens" and not c["finished"] for c in chunks[:-1])
            ends.append(chunks[-1])
        later = [c async for c in replica.generate("later", list(demo_ids[0]), long)]
        return ends, later

    try:
        ends, later = asyncio.run(asyncio.wait_for(scenario(), 120))
        for chunk in ends + later[-1:]:
            assert (chunk["type"], chunk["status"], chunk["error_type"]) == ("error", 503, "unavailable"), chunk
        assert "lost a tensor-parallel rank" in ends[0]["message"]
        assert ray.get(replica.group.host.__ray_call__.remote(_loop_after_failure)) == (True, False, 0, 0)
    finally:
        replica.shutdown()
