"""Disaggregated tensor parallelism: prefill TP P -> decode TP D, each decode rank READing its kv-head slices of
the target and draft layers from the prefill ranks holding them (NIXL over UCX on DRAM, gloo between ranks).
Float32 greedy output must not depend on the split."""

import asyncio
import json
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray

import ray  # noqa: E402

from actors.offline import encode_prompts  # noqa: E402
from actors.replica import AggregatedReplica, DecodeReplica, PrefillReplica  # noqa: E402
from engine.llm import EngineConfig  # noqa: E402
from engine.sequence import SamplingParams  # noqa: E402
from kv.rank_info import PeerMismatchError, RankInfo  # noqa: E402

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo"
SPLITS = [(1, 1), (2, 2), (2, 1), (1, 2)]


def demo_prompts(n=3):
    lines = (DEMO.parents[1] / "benchmarks" / "prompts" / "heldout.jsonl").read_text().splitlines()
    return [json.loads(line)["prompt"] for line in lines[:n]]


def requests(prompt_ids, tag, max_tokens=32):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return [(f"{tag}-{i}", list(ids), params) for i, ids in enumerate(prompt_ids)]


async def _disaggregated(prefill, decode, reqs):
    results = await asyncio.gather(*(prefill.prefill(*req) for req in reqs))
    tickets = [r["ticket"] for r in results]
    return tickets, await decode.decode_all(tickets)


def disaggregated(prefill, decode, reqs):
    """Prefill every request, then decode them all: (tickets, outputs)."""
    return asyncio.run(_disaggregated(prefill, decode, reqs))


def hold_stats(replica):
    return ray.get([kvm.hold_stats.remote() for kvm in replica.group.kv_managers])


def wait_free(replicas, timeout_s=10.0):
    """Pages in use on every rank of every replica, once they are all zero (or the timeout passed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        in_use = [r.group.pages_in_use_per_rank() for r in replicas]
        if not any(map(any, in_use)) or time.monotonic() > deadline:
            return in_use
        time.sleep(0.05)


@pytest.fixture(scope="module")
def demo(ray_cluster):
    """Aggregated TP 1 (the reference), prefill TP 1 and 2, decode TP 1 and 2, and an ablated decode TP 1, over
    the demo pair (4 heads, 2 kv heads; 6 target and 3 draft layers), float32, in this process."""
    config = EngineConfig(model=str(DEMO / "target"), draft=str(DEMO / "drafter"), num_pages=128,
                          max_num_batched_tokens=64)
    replicas = {"agg": AggregatedReplica(config)}
    for tp in (1, 2):
        replicas[f"prefill{tp}"] = PrefillReplica(config, tp_size=tp)
        replicas[f"decode{tp}"] = DecodeReplica(config, tp_size=tp)
    replicas["ablated1"] = DecodeReplica(config, tp_size=1, transfer_draft_kv=False)
    prompt_ids = encode_prompts(str(DEMO / "target"), demo_prompts())
    reference = asyncio.run(replicas["agg"].generate_all(requests(prompt_ids, "agg")))
    yield replicas, prompt_ids, reference
    for replica in replicas.values():
        replica.shutdown()


@pytest.mark.parametrize("prefill_tp,decode_tp", SPLITS)
def test_every_split_decodes_the_aggregated_tokens_and_acceptance(demo, prefill_tp, decode_tp):
    replicas, prompt_ids, reference = demo
    prefill, decode = replicas[f"prefill{prefill_tp}"], replicas[f"decode{decode_tp}"]
    reads_before = [s["read"] for s in hold_stats(prefill)]
    tickets, outputs = disaggregated(prefill, decode, requests(prompt_ids, f"split{prefill_tp}{decode_tp}"))
    assert [o.token_ids for o in outputs] == [o.token_ids for o in reference]
    # Per step, not only on average: the drafter context travelled whole, in every decode rank's heads.
    assert [o.acceptance_lengths for o in outputs] == [o.acceptance_lengths for o in reference]
    steps = [al for o in reference for al in o.acceptance_lengths]
    assert sum(steps) / len(steps) > 1.5
    # Each prefill rank's lease ended once per request, after every decode rank reading it (1 -> 2: both).
    assert [s["read"] - b for s, b in zip(hold_stats(prefill), reads_before)] == [len(tickets)] * prefill_tp
    assert all((s["held"], s["reading"]) == (0, 0) for s in hold_stats(prefill))
    assert wait_free([prefill, decode]) == [[0] * prefill_tp, [0] * decode_tp]


def test_each_decode_rank_reads_its_head_slice_bytes(demo):
    """1 -> 2: each decode rank READs one of the two kv heads, so the two ranks together move what 1 -> 1 moves,
    target and draft layers alike. Pages are head-major, so a rank's head of a page's K (or V) is one run of
    page_size x head dim x 4 bytes: one fragment per page, layer and K/V, which cannot coalesce further (the
    other head sits between them at the prefill rank)."""
    replicas, prompt_ids, _ = demo
    reqs = requests([prompt_ids[0][::-1]], "bytes", max_tokens=4)      # a prompt no decode replica holds pages of

    async def transfer_stats(decode_tp):
        rid, ids, params = reqs[0]
        ticket = (await replicas["prefill1"].prefill(f"{rid}-{decode_tp}", ids, params))["ticket"]
        chunks = [chunk async for chunk in replicas[f"decode{decode_tp}"].decode(ticket)]
        return chunks[0]["transfer"]

    stats = {tp: asyncio.run(transfer_stats(tp)) for tp in (1, 2)}
    pages = len(stats[1]["tables"][0])
    assert stats[1]["reused_pages"] == stats[2]["reused_pages"] == 0
    assert stats[2]["bytes"] == stats[1]["bytes"] == pages * 9 * 2 * 16 * 2 * 64 * 4
    assert stats[1]["descriptors"] <= pages                          # whole pages, adjacent ones coalesced
    # Per decode rank: one fragment per page, layer and K/V, of its head's 16 tokens.
    assert stats[2]["descriptors"] == 2 * pages * 9 * 2


def test_ablation_lowers_acceptance_for_a_split(demo):
    replicas, prompt_ids, reference = demo
    _, ablated = disaggregated(replicas["prefill2"], replicas["ablated1"], requests(prompt_ids, "ablated21"))
    assert [o.token_ids for o in ablated] == [o.token_ids for o in reference]      # lossless all the same

    def mean_al(outputs):
        steps = [al for o in outputs for al in o.acceptance_lengths]
        return sum(steps) / len(steps)

    assert mean_al(ablated) < mean_al(reference) - 0.05
    assert wait_free([replicas["prefill2"], replicas["ablated1"]]) == [[0, 0], [0]]


def test_a_lease_with_two_readers_is_freed_after_both(demo):
    """1 -> 2: both decode ranks READ prefill rank 0's lease; the first to end must not free the pages."""
    kvm = demo[0]["prefill1"].group.kv_managers[0]
    before = ray.get(kvm.hold_stats.remote())
    ray.get(kvm.hold.remote("two-readers", "two-readers#1", 30.0))
    assert ray.get(kvm.begin_read.remote("two-readers#1", 10.0, "decode-rank0", 2)) is True
    assert ray.get(kvm.begin_read.remote("two-readers#1", 10.0, "decode-rank1", 2)) is True
    assert ray.get(kvm.begin_read.remote("two-readers#1", 10.0, "decode-rank1", 2)) is False     # once per reader
    ray.get(kvm.end_read.remote("two-readers#1", "decode-rank0"))
    assert ray.get(kvm.hold_stats.remote())["reading"] == before["reading"] + 1
    ray.get(kvm.end_read.remote("two-readers#1", "decode-rank1"))
    after = ray.get(kvm.hold_stats.remote())
    assert (after["reading"], after["read"]) == (before["reading"], before["read"] + 1)


def test_a_split_that_cannot_be_mapped_is_refused_at_registration(demo):
    replicas = demo[0]
    decode_kvm = replicas["decode2"].group.kv_managers[0]
    payload = json.loads(replicas["prefill1"].group.rank_infos[0])
    payload.update(tp_size=3, agent_name="three-way")       # 2 kv heads over 3 ranks: no rank holds a whole slice
    with pytest.raises(PeerMismatchError, match=r"tensor-parallel size differs \(this rank 2, peer 3\) and the "
                                                r"split cannot be mapped: layer target\.0: 2 kv heads neither split"):
        ray.get(decode_kvm.register_peer.remote(json.dumps(payload)))
    # A prefill replica's rank list must be whole: rank 1 of 2 alone cannot serve decode rank 0's head.
    half = replicas["prefill2"].group.rank_infos[1:]
    with pytest.raises(PeerMismatchError, match="rank list is incomplete"):
        ray.get(decode_kvm.register_peers.remote(half, [None]))
    assert RankInfo.from_json(replicas["prefill2"].group.rank_infos[1]).layers[0].kv_head_start == 1


def test_cli_generate_disagg_2_to_1_prints_the_aggregated_json(ray_cluster, capsys):
    from serve_app.cli import main

    args = ["generate", "--json", "--max-tokens", "24", "--prompt", demo_prompts(1)[0]]
    records = []
    for extra in ([], ["--mode", "disagg", "--prefill-tp", "2", "--decode-tp", "1"]):
        assert main(args + extra) == 0
        # The JSON line, past any warning Ray's raylet prints to the driver (many worker processes started).
        records.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert records[1] == records[0]
    assert records[1]["mean_acceptance_length"] > 1.5 and len(records[1]["acceptance_lengths"]) > 1
