"""Disaggregated prefill/decode on a real local Ray cluster with real NIXL (UCX over DRAM) between actors."""

import json
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray

ray = pytest.importorskip("ray")

from actors.nixl_transfer import TransferError  # noqa: E402
from actors.offline import run_disaggregated  # noqa: E402
from actors.replica import AggregatedReplica, DecodeReplica, PrefillReplica  # noqa: E402
from engine.llm import EngineConfig  # noqa: E402
from engine.sequence import SamplingParams  # noqa: E402
from kv.rank_info import PeerMismatchError, RankInfo  # noqa: E402
from tests import checkpoints  # noqa: E402

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo"
LAYOUTS = {"fp8-bf16": ("fp8", "bf16"), "bf16-bf16": ("bf16", "bf16")}
# Lengths around page boundaries (page size 16): partial, exact, several pages.
TINY_PROMPTS = [[(7 * i + 3 * j) % 120 + 1 for j in range(n)] for i, n in enumerate([5, 16, 33, 47])]


class Stack:
    """One aggregated replica and one prefill/decode pair over the same engine config."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.agg = AggregatedReplica(config)
        self.prefill = PrefillReplica(config)
        self.decode = DecodeReplica(config)
        self.decode.connect(self.prefill.rank_infos)
        self.groups = [self.agg.group, self.prefill.group, self.decode.group]

    def shutdown(self):
        for replica in (self.agg, self.prefill, self.decode):
            replica.shutdown()


def requests(prompts, max_tokens=24, tag="r"):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return [(f"{tag}-{i}", list(p), params) for i, p in enumerate(prompts)]


def wait_pages_free(stack: Stack, timeout_s: float = 5.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while True:
        in_use = [g.pages_in_use() for g in stack.groups]
        if not any(in_use) or time.monotonic() > deadline:
            return in_use


@pytest.fixture(scope="module")
def tiny_drafter(tmp_path_factory):
    return checkpoints.write_tiny_drafter(tmp_path_factory.mktemp("tiny_drafter"))


@pytest.fixture(scope="module", params=list(LAYOUTS))
def tiny(request, ray_cluster, tiny_target, tiny_drafter):
    target_kv, draft_kv = LAYOUTS[request.param]
    stack = Stack(EngineConfig(model=str(tiny_target), draft=str(tiny_drafter), num_pages=64,
                               kv_cache_dtype=target_kv, draft_kv_cache_dtype=draft_kv))
    yield stack
    stack.shutdown()


@pytest.fixture(autouse=True)
def _pages_return_to_zero(request):
    """After every test, pages in use on every replica are back to zero (finished, timed out or failed)."""
    yield
    for name in ("tiny", "demo"):
        if name in request.fixturenames:
            stack = request.getfixturevalue(name)
            assert wait_pages_free(stack) == [0, 0, 0]


def test_disaggregated_equals_aggregated_on_tiny_pair(tiny):
    reqs = requests(TINY_PROMPTS)
    agg = tiny.agg.generate(reqs)
    disagg, timings = run_disaggregated(tiny.prefill, tiny.decode, reqs)
    assert [o.token_ids for o in disagg] == [o.token_ids for o in agg]
    assert [o.acceptance_lengths for o in disagg] == [o.acceptance_lengths for o in agg]
    assert all(len(o.token_ids) == 24 for o in disagg)
    assert len(timings.read_s) == len(reqs)


def test_transfer_moves_target_and_draft_pages_byte_for_byte(tiny):
    info = RankInfo.from_json(tiny.decode.group.ranks[0].rank_info)
    sizes = {layer.owner: layer.element_size for layer in info.layers}
    assert sizes["draft"] == 2 and sizes["target"] == (1 if tiny.config.kv_cache_dtype == "fp8" else 2)
    tickets, _ = tiny.prefill.prefill(requests(TINY_PROMPTS[2:3], tag="bytes"))
    ticket = tickets[0]
    prefill_worker, decode_worker = tiny.prefill.group.worker, tiny.decode.group.worker
    before = {o: ray.get(prefill_worker.page_digest.remote(ticket.tables, (o,))) for o in ("target", "draft")}
    stats = tiny.decode.receive(ticket)
    after = {o: ray.get(decode_worker.page_digest.remote(stats["tables"], (o,))) for o in ("target", "draft")}
    assert after == before
    pages = sum(len(t) for t in ticket.tables)
    assert stats["bytes"] == pages * sum(g.page_stride for g in info.groups)
    tiny.decode.run()


def test_ablation_moves_target_layers_only_and_stays_lossless(tiny):
    reqs = requests(TINY_PROMPTS, tag="ablate")
    agg = tiny.agg.generate(reqs)
    tiny.decode.transfer_draft_kv = False
    try:
        tickets, _ = tiny.prefill.prefill(reqs[2:3])
        draft_before = ray.get(tiny.prefill.group.worker.page_digest.remote(tickets[0].tables, ("draft",)))
        target_before = ray.get(tiny.prefill.group.worker.page_digest.remote(tickets[0].tables, ("target",)))
        stats = tiny.decode.receive(tickets[0])
        worker = tiny.decode.group.worker
        assert ray.get(worker.page_digest.remote(stats["tables"], ("target",))) == target_before
        assert ray.get(worker.page_digest.remote(stats["tables"], ("draft",))) != draft_before
        tiny.decode.run()
        disagg, _ = run_disaggregated(tiny.prefill, tiny.decode, reqs)
    finally:
        tiny.decode.transfer_draft_kv = True
    assert [o.token_ids for o in disagg] == [o.token_ids for o in agg]


def _drop_draft_layers(payload: str, keep: int) -> str:
    data = json.loads(payload)
    data["layers"] = [l for l in data["layers"] if l["owner"] == "target" or l["layer_index"] < keep]
    data["num_draft_layers"] = keep
    return json.dumps(data)


def _add_draft_layer(payload: str) -> str:
    data = json.loads(payload)
    extra = dict(next(l for l in data["layers"] if l["owner"] == "draft"), layer_index=1)
    data["layers"].append(extra)
    data["num_draft_layers"] += 1
    return json.dumps(data)


def test_peer_registration_refuses_draft_layer_mismatch_and_accepts_match(tiny):
    kvm = tiny.decode.group.kv_manager
    payload = tiny.prefill.rank_infos[0]
    with pytest.raises(PeerMismatchError, match=r"number of draft layers differs \(this rank 1, peer 0\)"):
        ray.get(kvm.register_peer.remote(_drop_draft_layers(payload, 0)))
    with pytest.raises(PeerMismatchError, match=r"number of draft layers differs \(this rank 1, peer 2\)"):
        ray.get(kvm.register_peer.remote(_add_draft_layer(payload)))
    assert ray.get(kvm.register_peer.remote(payload)) == json.loads(payload)["agent_name"]


def test_unread_prefill_pages_are_freed_by_the_hold_timeout(tiny):
    kvm = tiny.prefill.group.kv_manager
    timed_out = ray.get(kvm.hold_stats.remote())["timed_out"]
    tickets, _ = tiny.prefill.prefill(requests(TINY_PROMPTS[:2], tag="never-read"), hold_timeout_s=0.3)
    assert tiny.prefill.group.pages_in_use() > 0
    deadline = time.monotonic() + 5
    while tiny.prefill.group.pages_in_use() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tiny.prefill.group.pages_in_use() == 0
    assert ray.get(kvm.hold_stats.remote())["timed_out"] == timed_out + len(tickets)


def test_failed_transfer_fails_the_request_and_frees_both_sides(tiny):
    """The decode side registers the prefill peer with descriptors that point outside its registered memory
    (as after the peer re-registered its pool): NIXL itself refuses the READ."""
    kvm = tiny.decode.group.kv_manager
    payload = tiny.prefill.rank_infos[0]
    stale = json.loads(payload)
    for group in stale["groups"]:
        group["base_address"] += 1 << 40
    ray.get(kvm.register_peer.remote(json.dumps(stale)))
    cancelled = ray.get(tiny.prefill.group.kv_manager.hold_stats.remote())["cancelled"]
    try:
        tickets, _ = tiny.prefill.prefill(requests(TINY_PROMPTS[1:2], tag="fail"), hold_timeout_s=60)
        with pytest.raises(TransferError, match="request fail-0 failed: KV transfer from .* could not start"):
            tiny.decode.receive(tickets[0])
    finally:
        ray.get(kvm.register_peer.remote(payload))
    assert tiny.decode.group.pages_in_use() == 0
    deadline = time.monotonic() + 5
    while tiny.prefill.group.pages_in_use() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tiny.prefill.group.pages_in_use() == 0     # freed by the cancel notification, long before the hold expires
    assert ray.get(tiny.prefill.group.kv_manager.hold_stats.remote())["cancelled"] == cancelled + 1


# --- the demo pair: acceptance that means something ---------------------------------------------------------
def demo_prompts(n=4):
    """Held-out source snippets (modules the demo pair never trained on)."""
    lines = (DEMO.parents[1] / "benchmarks" / "prompts" / "heldout.jsonl").read_text().splitlines()
    return [json.loads(line)["prompt"] for line in lines[:n]]


@pytest.fixture(scope="module", params=list(LAYOUTS))
def demo(request, ray_cluster):
    assert (DEMO / "target").is_dir() and (DEMO / "drafter").is_dir(), f"the bundled demo pair is missing: {DEMO}"
    target_kv, draft_kv = LAYOUTS[request.param]
    stack = Stack(EngineConfig(model=str(DEMO / "target"), draft=str(DEMO / "drafter"), num_pages=256,
                               kv_cache_dtype=target_kv, draft_kv_cache_dtype=draft_kv))
    yield stack
    stack.shutdown()


def demo_requests(tag):
    from actors.offline import encode_prompts
    return requests(encode_prompts(str(DEMO / "target"), demo_prompts()), max_tokens=48, tag=tag)


def test_demo_disaggregated_acceptance_equals_aggregated(demo):
    reqs = demo_requests("demo")
    agg = demo.agg.generate(reqs)
    disagg, _ = run_disaggregated(demo.prefill, demo.decode, reqs)
    assert [o.token_ids for o in disagg] == [o.token_ids for o in agg]
    assert [o.acceptance_lengths for o in disagg] == [o.acceptance_lengths for o in agg]
    assert sum(o.mean_acceptance_length for o in agg) / len(agg) > 2.0     # a trained drafter, not a random one


def test_demo_ablation_lowers_acceptance_and_stays_lossless(demo):
    reqs = demo_requests("demo-ablate")
    agg = demo.agg.generate(reqs)
    demo.decode.transfer_draft_kv = False
    try:
        ablated, _ = run_disaggregated(demo.prefill, demo.decode, reqs)
    finally:
        demo.decode.transfer_draft_kv = True
    assert [o.token_ids for o in ablated] == [o.token_ids for o in agg]

    def mean_al(outputs):
        drafts = sum(len(o.acceptance_lengths) for o in outputs)
        return sum(sum(o.acceptance_lengths) for o in outputs) / drafts

    assert mean_al(ablated) < mean_al(agg) - 0.05
