"""Disaggregated prefill/decode on a real local Ray cluster with real NIXL (UCX over DRAM) between actors.

The replicas are the ones the Serve deployments run, started as Ray actors the way `generate --mode disagg`
starts them.
"""

import asyncio
import json
import os
import queue
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray

import ray  # noqa: E402

from actors.offline import ReplicaActor, run_disaggregated  # noqa: E402
from actors.replica import AggregatedReplica, DecodeReplica, PrefillReplica  # noqa: E402
from actors.worker import rank_actor  # noqa: E402
from engine.llm import EngineConfig  # noqa: E402
from engine.sequence import SamplingParams  # noqa: E402
from kv.rank_info import PeerMismatchError, RankInfo  # noqa: E402
from tests import checkpoints  # noqa: E402

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo"
LAYOUTS = {"fp8-bf16": ("fp8", "bf16"), "bf16-bf16": ("bf16", "bf16")}
# Lengths around page boundaries (page size 16): partial, exact, several pages.
TINY_PROMPTS = [[(7 * i + 3 * j) % 120 + 1 for j in range(n)] for i, n in enumerate([5, 16, 33, 47])]


class Stack:
    """An aggregated replica, a prefill replica and decode replicas (with and without the draft-layer
    transfer), each a Ray actor over one engine config."""

    def __init__(self, config: EngineConfig, *, prefill_kwargs=None, decode_kwargs=None, ablated=True):
        self.config = config
        self.agg = ReplicaActor(AggregatedReplica, config)
        self.prefill = ReplicaActor(PrefillReplica, config, **(prefill_kwargs or {}))
        self.decode = ReplicaActor(DecodeReplica, config, **(decode_kwargs or {}))
        self.replicas = [self.agg, self.prefill, self.decode]
        if ablated:
            self.ablated = ReplicaActor(DecodeReplica, config, transfer_draft_kv=False)
            self.replicas.append(self.ablated)

    def generate(self, reqs):
        return ray.get(self.agg.handle.generate_all.remote(reqs))

    def prefill_all(self, reqs):
        return [r["ticket"] for r in ray.get([self.prefill.handle.prefill.remote(*req) for req in reqs])]

    def shutdown(self):
        for replica in self.replicas:
            replica.shutdown()


def requests(prompts, max_tokens=24, tag="r"):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return [(f"{tag}-{i}", list(p), params) for i, p in enumerate(prompts)]


def wait_pages_free(stack: Stack, timeout_s: float = 5.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while True:
        in_use = [r.pages_in_use() for r in stack.replicas]
        if not any(in_use) or time.monotonic() > deadline:
            return in_use


def wait_until(condition, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def tiny_drafter(tmp_path_factory):
    return checkpoints.write_tiny_drafter(tmp_path_factory.mktemp("tiny_drafter"))


def tiny_config(tiny_target, tiny_drafter, **kwargs):
    return EngineConfig(model=str(tiny_target), draft=str(tiny_drafter), num_pages=64, **kwargs)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def tiny(request, ray_cluster, tiny_target, tiny_drafter):
    target_kv, draft_kv = LAYOUTS[request.param]
    stack = Stack(tiny_config(tiny_target, tiny_drafter, kv_cache_dtype=target_kv, draft_kv_cache_dtype=draft_kv))
    yield stack
    stack.shutdown()


@pytest.fixture(scope="module")
def short_holds(ray_cluster, tiny_target, tiny_drafter):
    """Holds expire after 0.3 s; a decode stand-by waits 1 s for its ticket."""
    stack = Stack(tiny_config(tiny_target, tiny_drafter), prefill_kwargs={"hold_timeout_s": 0.3},
                  decode_kwargs={"ticket_timeout_s": 1.0}, ablated=False)
    yield stack
    stack.shutdown()


@pytest.fixture(scope="module")
def slow_reads(ray_cluster, tiny_target, tiny_drafter):
    """Every READ of the decode replica is held open for 3 s: a fault injected in its KV manager, since on
    this machine a READ of a few pages ends within microseconds, too soon to cancel in the middle."""
    stack = Stack(tiny_config(tiny_target, tiny_drafter), decode_kwargs={"read_delay_s": 3.0}, ablated=False)
    yield stack
    stack.shutdown()


@pytest.fixture(autouse=True)
def _pages_return_to_zero(request):
    """After every test, pages in use on every replica are back to zero (finished, timed out or failed)."""
    yield
    for name in ("tiny", "demo", "short_holds", "slow_reads"):
        if name in request.fixturenames:
            stack = request.getfixturevalue(name)
            assert wait_pages_free(stack) == [0] * len(stack.replicas)


def test_disaggregated_equals_aggregated_on_tiny_pair(tiny):
    reqs = requests(TINY_PROMPTS)
    agg = tiny.generate(reqs)
    disagg, _ = run_disaggregated(tiny.prefill, tiny.decode, reqs)
    assert [o.token_ids for o in disagg] == [o.token_ids for o in agg]
    assert [o.acceptance_lengths for o in disagg] == [o.acceptance_lengths for o in agg]
    assert all(len(o.token_ids) == 24 for o in disagg)


def test_seeded_sampling_disaggregated_equals_aggregated(tiny):
    """A seeded request's first token is drawn on the prefill side and the rest on the decode side, which goes on
    from the prefill's generator state (in the ticket): the output is the aggregated one, token for token."""
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)
    reqs = [(f"seeded-{i}", list(p), params) for i, p in enumerate(TINY_PROMPTS)]
    agg = tiny.generate(reqs)
    disagg, _ = run_disaggregated(tiny.prefill, tiny.decode, reqs)
    assert [o.token_ids for o in disagg] == [o.token_ids for o in agg]
    assert [o.token_ids for o in agg] != [o.token_ids for o in tiny.generate(
        [(f"other-{i}", p, SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=12, ignore_eos=True))
         for i, (_, p, _) in enumerate(reqs)])]          # the seed decides the draws


def digests(replica, tables, owners=("target", "draft")):
    return {o: ray.get(replica.handle.page_digest.remote(tables, (o,))) for o in owners}


def decode_chunks(replica, ticket) -> list[dict]:
    """Every chunk of one decode stream, read through Ray's streaming generator."""
    return [ray.get(ref) for ref in replica.handle.decode.options(num_returns="streaming").remote(ticket)]


def test_transfer_moves_target_and_draft_pages_byte_for_byte_and_skips_pages_the_decode_side_holds(tiny):
    """A prompt's pages arrive byte for byte, target and draft layers, the hand-off's calls over the KV managers'
    channels. The same prompt again: its leading full page
    is in the decode side's prefix cache (the first request's, drafter context included), so the READ moves only
    the page after it, and the decode side's pages still equal the prefill side's."""
    info = RankInfo.from_json(ray.get(tiny.decode.handle.rank_infos.remote())[0])
    sizes = {layer.owner: layer.element_size for layer in info.layers}
    assert sizes["draft"] == 2 and sizes["target"] == (1 if tiny.config.kv_cache_dtype == "fp8" else 2)
    stride = sum(g.page_stride for g in info.groups)
    # 32 tokens no other test sends: two full pages, which decoding (positions 32 on) never writes again. A prefix
    # hit leaves the last token's page to compute, so the repeat reuses one page.
    prompt = [(5 * j + 11) % 120 + 1 for j in range(32)]
    kvms = {side: ray.get(getattr(tiny, side).handle.kv_managers.remote())[0] for side in ("prefill", "decode")}

    def channel_calls() -> dict[str, int]:
        return {side: ray.get(kvm.channel_calls.remote()) for side, kvm in kvms.items()}

    for tag, reused in (("bytes", 0), ("bytes-again", 1)):
        ticket = tiny.prefill_all(requests([prompt], tag=tag))[0]
        before = digests(tiny.prefill, ticket.tables)
        calls = channel_calls()
        chunks = decode_chunks(tiny.decode, ticket)
        # The READ went to the decode KV manager, the lease check and its end to the prefill one, over channels.
        wait_until(lambda: channel_calls()["prefill"] >= calls["prefill"] + 2)
        assert channel_calls()["decode"] == calls["decode"] + 1
        stats = chunks[0]["transfer"]
        assert stats["reused_pages"] == reused
        assert digests(tiny.decode, stats["tables"]) == before
        moved = sum(len(t) - reused for t in ticket.tables)
        assert stats["bytes"] == moved * stride
        # Adjacent pages go as one descriptor: never more than one per page and group.
        assert 1 <= stats["descriptors"] <= moved * len(info.groups)
        assert sum(len(c["token_ids"]) for c in chunks) == 24 and chunks[-1]["finish_reason"] == "length"


def test_ablation_moves_target_layers_only_and_stays_lossless(tiny):
    reqs = requests(TINY_PROMPTS, tag="ablate")
    agg = tiny.generate(reqs)
    ticket = tiny.prefill_all(requests([TINY_PROMPTS[3][:32]], tag="ablate-bytes"))[0]
    before = digests(tiny.prefill, ticket.tables)
    stats = decode_chunks(tiny.ablated, ticket)[0]["transfer"]
    after = digests(tiny.ablated, stats["tables"])
    assert after["target"] == before["target"] and after["draft"] != before["draft"]
    disagg, _ = run_disaggregated(tiny.prefill, tiny.ablated, reqs)
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
    kvm = ray.get(tiny.decode.handle.kv_managers.remote())[0]
    payload = ray.get(tiny.prefill.handle.rank_infos.remote())[0]
    with pytest.raises(PeerMismatchError, match=r"number of draft layers differs \(this rank 1, peer 0\)"):
        ray.get(kvm.register_peer.remote(_drop_draft_layers(payload, 0)))
    with pytest.raises(PeerMismatchError, match=r"number of draft layers differs \(this rank 1, peer 2\)"):
        ray.get(kvm.register_peer.remote(_add_draft_layer(payload)))
    assert ray.get(kvm.register_peer.remote(payload)) == json.loads(payload)["agent_name"]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (/proc/PID/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_idle_kv_managers_use_no_cpu(tiny):
    """Waiting is blocking: an idle KV manager (no NIXL progress thread, no poller) stays under 2% of a core."""
    managers = [ray.get(r.handle.kv_managers.remote())[0] for r in (tiny.prefill, tiny.decode)]
    pids = [ray.get(kvm.__ray_call__.remote(lambda self: os.getpid())) for kvm in managers]
    before, start = [cpu_seconds(pid) for pid in pids], time.monotonic()
    time.sleep(3)
    elapsed = time.monotonic() - start
    fractions = [(cpu_seconds(pid) - b) / elapsed for pid, b in zip(pids, before)]
    assert max(fractions) < 0.02, fractions


def hold_stats(stack):
    return ray.get(ray.get(stack.prefill.handle.kv_managers.remote())[0].hold_stats.remote())


def stand_by(replica, request):
    """A decode stand-by's stream (as the ingress opens it with the prefill), and its first chunk."""
    stream = replica.handle.stand_by.options(num_returns="streaming").remote(*request)
    return stream, ray.get(next(stream))


def test_the_decode_side_reserves_while_the_prefill_runs_and_takes_the_ticket_handed_to_its_process(tiny):
    """The ingress's path: the decode replica is called as the prefill starts; its engine's process reserves the
    prompt's pages before any ticket exists and names itself; the ticket handed to that process by an actor call
    starts the READ; the output equals the aggregated replica's. A second hand of the same ticket is refused."""
    prompt = [(5 * j + 17) % 120 + 1 for j in range(40)]          # 41 tokens with the first: 3 pages
    request = requests([prompt], tag="standing")[0]
    solo = tiny.generate([("standing-solo", *request[1:])])[0]
    stream, standby = stand_by(tiny.decode, request)
    assert standby["type"] == "standby" and standby["host"].endswith("-worker")
    wait_until(lambda: tiny.decode.pages_in_use() == 3)       # reserved with no ticket yet
    ticket = tiny.prefill_all([request])[0]
    host = rank_actor(standby["host"])
    assert ray.get(host.hand.remote(ticket.handoff())) is True
    chunks = [ray.get(ref) for ref in stream]
    assert [t for c in chunks for t in c["token_ids"]] == solo.token_ids
    assert chunks[0]["transfer"]["bytes"] > 0 and chunks[-1]["finished"]
    assert ray.get(host.hand.remote(ticket.handoff())) is False


def test_a_stand_by_closed_before_its_ticket_frees_its_reservation_and_a_late_ticket_goes_back(tiny):
    """The client went away while the prefill ran: closing the decode stream frees the pages reserved for it; the
    ticket that comes after is refused and its prefill pages are given back at once, not at the hold timeout."""
    prompt = [(3 * j + 29) % 120 + 1 for j in range(40)]
    request = requests([prompt], tag="gone")[0]
    stream, standby = stand_by(tiny.decode, request)
    wait_until(lambda: tiny.decode.pages_in_use() == 3)
    ray.cancel(stream)
    wait_until(lambda: tiny.decode.pages_in_use() == 0, 5)
    cancelled = hold_stats(tiny)["cancelled"]
    ticket = tiny.prefill_all([request])[0]
    assert ray.get(rank_actor(standby["host"]).hand.remote(ticket.handoff())) is False
    wait_until(lambda: hold_stats(tiny)["cancelled"] == cancelled + 1, 5)
    wait_until(lambda: tiny.prefill.pages_in_use() == 0, 5)


def test_a_dropped_stand_by_ends_its_stream_and_frees_its_reservation(tiny):
    """What the router does for a request that will get no ticket (it ended at the prefill, or its client went away
    first): ``drop`` at the engine's process ends the stand-by's stream with an error chunk and frees its pages."""
    prompt = [(9 * j + 2) % 120 + 1 for j in range(40)]
    stream, standby = stand_by(tiny.decode, requests([prompt], tag="dropped")[0])
    wait_until(lambda: tiny.decode.pages_in_use() == 3)
    ray.get(rank_actor(standby["host"]).drop.remote("dropped-0"))
    chunks = [ray.get(ref) for ref in stream]
    assert [c["type"] for c in chunks] == ["error"] and chunks[0]["status"] == 499, chunks
    assert tiny.decode.pages_in_use() == 0


def test_a_stand_by_whose_ticket_never_comes_ends_with_a_504_and_frees_its_pages(short_holds):
    prompt = [(7 * j + 11) % 120 + 1 for j in range(20)]
    stream, standby = stand_by(short_holds.decode, requests([prompt], tag="no-ticket")[0])
    assert standby["type"] == "standby"
    assert short_holds.decode.pages_in_use() == 2         # reserved (the command is answered once it is queued)
    start = time.monotonic()
    chunks = [ray.get(ref) for ref in stream]
    assert [c["type"] for c in chunks] == ["error"] and chunks[0]["status"] == 504, chunks
    assert "did not reach the decode replica within 1 s" in chunks[0]["message"]
    assert 0.5 < time.monotonic() - start < 5
    assert short_holds.decode.pages_in_use() == 0


def test_unread_prefill_pages_are_freed_by_the_hold_timeout(short_holds):
    timed_out = hold_stats(short_holds)["timed_out"]
    tickets = short_holds.prefill_all(requests(TINY_PROMPTS[:2], tag="never-read"))
    assert short_holds.prefill.pages_in_use() > 0
    wait_until(lambda: short_holds.prefill.pages_in_use() == 0)
    assert hold_stats(short_holds)["timed_out"] == timed_out + len(tickets)


def test_a_renewed_hold_outlives_its_timeout_and_then_decodes(short_holds):
    """``Ticket.keep_held`` (what the ingress runs while a request's decode call waits) keeps a 0.3 s hold for
    1.5 s; the request then decodes its solo output. Once the renewals stop the hold expires, and renewing it
    then says it is gone."""
    solo = short_holds.generate(requests(TINY_PROMPTS[2:3], tag="solo-renewed"))[0]
    ticket = short_holds.prefill_all(requests(TINY_PROMPTS[2:3], tag="renewed"))[0]
    assert ticket.hold_s == 0.3
    renewed = hold_stats(short_holds)["renewed"]

    async def keep_for(seconds: float) -> None:
        keeper = asyncio.ensure_future(ticket.keep_held())
        await asyncio.sleep(seconds)
        assert not keeper.done()        # every renewal found the hold
        keeper.cancel()

    asyncio.run(keep_for(1.5))
    assert hold_stats(short_holds)["renewed"] >= renewed + 4
    assert short_holds.prefill.pages_in_use() > 0
    chunks = decode_chunks(short_holds.decode, ticket)
    assert [t for c in chunks for t in c["token_ids"]] == solo.token_ids
    wait_until(lambda: short_holds.prefill.pages_in_use() == 0 and short_holds.decode.pages_in_use() == 0)

    lapsed = short_holds.prefill_all(requests(TINY_PROMPTS[1:2], tag="lapsed"))[0]
    wait_until(lambda: short_holds.prefill.pages_in_use() == 0)        # not renewed: the 0.3 s hold ran out
    assert asyncio.run(lapsed.pages().renew()) == [False]
    assert asyncio.run(asyncio.wait_for(lapsed.keep_held(), 2)) is None      # returns at the first renewal


def test_an_expired_hold_is_never_served_and_fails_cleanly(short_holds):
    """The lease expired before the decode side began its READ: the lease check refuses it, and the bytes the READ
    copied meanwhile (the pages may already hold another request's KV) are discarded; the request fails with a
    transfer error, and both sides free everything."""
    refused = hold_stats(short_holds)["refused"]
    ticket = short_holds.prefill_all(requests(TINY_PROMPTS[1:2], tag="expired"))[0]
    wait_until(lambda: short_holds.prefill.pages_in_use() == 0)        # the 0.3 s hold ran out
    chunks = decode_chunks(short_holds.decode, ticket)
    assert [c["type"] for c in chunks] == ["error"] and chunks[0]["error_type"] == "transfer_error"
    assert "expired or was cancelled" in chunks[0]["message"]
    assert hold_stats(short_holds)["refused"] == refused + 1


def test_a_cancel_during_a_slow_read_frees_after_it_and_others_are_unaffected(slow_reads):
    """A client that goes away while its READ is in flight: the pages stay until the READ ends, then both
    sides free them; a request decoded right after gets exactly its solo output."""
    stack = slow_reads
    solo = stack.generate(requests(TINY_PROMPTS[2:3], tag="solo"))[0]
    ticket = stack.prefill_all(requests(TINY_PROMPTS[3:4], tag="cancelled"))[0]
    stream = stack.decode.handle.decode.options(num_returns="streaming").remote(ticket)
    wait_until(lambda: hold_stats(stack)["reading"] == 1, 5)      # the READ has begun; it is held open for 3 s
    ray.cancel(stream)
    time.sleep(0.5)
    assert hold_stats(stack)["reading"] == 1
    assert stack.decode.pages_in_use() > 0, "pages were freed while the READ could still write into them"
    wait_until(lambda: stack.decode.pages_in_use() == 0 and stack.prefill.pages_in_use() == 0)
    ticket = stack.prefill_all(requests(TINY_PROMPTS[2:3], tag="after"))[0]
    chunks = decode_chunks(stack.decode, ticket)
    assert [t for c in chunks for t in c["token_ids"]] == solo.token_ids


def test_a_refused_lease_frees_the_decode_pages_only_after_its_read(slow_reads):
    """The READ starts while its lease check is in flight. A lease cancelled before the READ: the check refuses
    it at once, but the READ (held open for 3 s) may still write into the decode pages, so they stay reserved
    until it ends; then the request fails with a transfer error, and no other request ever gets those bytes."""
    stack = slow_reads
    refused = hold_stats(stack)["refused"]
    ticket = stack.prefill_all(requests(TINY_PROMPTS[3:4], tag="refused"))[0]
    ticket.cancel()
    wait_until(lambda: stack.prefill.pages_in_use() == 0)
    stream = stack.decode.handle.decode.options(num_returns="streaming").remote(ticket)
    wait_until(lambda: hold_stats(stack)["refused"] == refused + 1, 5)
    time.sleep(1.0)
    assert stack.decode.pages_in_use() > 0, "pages were freed while the refused READ could still write into them"
    chunks = [ray.get(ref) for ref in stream]
    assert [c["type"] for c in chunks] == ["error"] and chunks[0]["error_type"] == "transfer_error", chunks
    assert "expired or was cancelled" in chunks[0]["message"]


def test_a_reservation_waits_behind_a_full_pool_and_fails_cleanly_after_its_timeout_or_cancel(ray_cluster, tiny_target,
                                                                                              tiny_drafter):
    """A decode replica whose pool one request fills (8 pages) while its READ is held open for 3 s. A request whose
    client goes away while it waits for pages gives its prefill pages back at once (not at the 30 s hold timeout).
    The next waits in the engine's reservation queue, is refused with a 503 once its reserve timeout (1 s) has
    passed, and gives its prefill pages back; the first decodes to its end. Nothing stays in use."""
    prefill = ReplicaActor(PrefillReplica, tiny_config(tiny_target, tiny_drafter))
    decode = ReplicaActor(DecodeReplica, EngineConfig(model=str(tiny_target), draft=str(tiny_drafter), num_pages=8),
                          read_delay_s=3.0, reserve_timeout_s=1.0)

    def awaiting_transfer() -> int:
        return ray.get(ray.get(decode.handle.__ray_call__.remote(lambda r: r.group.host.gauges.remote())))[
            "awaiting_transfer"]

    try:
        prompts = [[(11 * i + j) % 120 + 1 for j in range(80)] for i in range(3)]      # 5 pages each
        first, second, third = [r["ticket"] for r in ray.get([prefill.handle.prefill.remote(*req)
                                                              for req in requests(prompts, tag="full")])]
        stream = decode.handle.decode.options(num_returns="streaming").remote(first)
        held = prefill.pages_in_use()        # three prompts' alike
        kvm = ray.get(prefill.handle.kv_managers.remote())[0]
        wait_until(lambda: ray.get(kvm.hold_stats.remote())["reading"] == 1, 10)      # held open for 3 s
        cancelled = ray.get(kvm.hold_stats.remote())["cancelled"]
        gone = decode.handle.decode.options(num_returns="streaming").remote(third)
        wait_until(lambda: awaiting_transfer() == 2, 2)        # the first READs, the third waits for pages
        ray.cancel(gone)
        wait_until(lambda: ray.get(kvm.hold_stats.remote())["cancelled"] == cancelled + 1, 0.8)     # < its 1 s timeout
        wait_until(lambda: prefill.pages_in_use() == held * 2 // 3, 2)     # the first's and the second's
        start = time.monotonic()
        refused = decode_chunks(decode, second)
        waited = time.monotonic() - start
        assert [c["type"] for c in refused] == ["error"] and refused[0]["status"] == 503, refused
        assert refused[0]["message"] == "no decode KV pages free"
        assert 1.0 <= waited < 3.0, f"refused after {waited:.2f} s, not after its 1 s reserve timeout"
        chunks = [ray.get(ref) for ref in stream]
        assert chunks[-1]["finished"] and sum(len(c["token_ids"]) for c in chunks) == 24, chunks[-1]
        assert chunks[0]["transfer"]["reused_pages"] == 0 and len(chunks[0]["transfer"]["tables"][0]) == 5
        wait_until(lambda: prefill.pages_in_use() == 0 and decode.pages_in_use() == 0)
        assert awaiting_transfer() == 0
    finally:
        decode.shutdown()
        prefill.shutdown()


def _settle_slowly(host, seconds: float, fail: bool) -> None:
    """In a decode engine's process: every reservation's ``pages_settled`` gives an event that completes ``seconds``
    later (or whose wait fails), as a GPU's would while a step launched ahead still runs."""
    import time as clock

    class Settle:
        def __init__(self):
            self.until = clock.monotonic() + seconds

        def query(self) -> bool:
            return clock.monotonic() >= self.until

        def synchronize(self) -> None:
            if fail:
                raise RuntimeError("device lost")
            clock.sleep(max(0.0, self.until - clock.monotonic()))

    host.engine.pages_settled = Settle


def _settle_at_once(host) -> None:
    del host.engine.pages_settled


@pytest.mark.parametrize("fail", [False, True])
def test_a_read_waits_for_the_device_to_settle_the_reserved_pages_off_the_engine_thread(tiny, fail):
    """A reservation on a GPU hands its READ an event that completes once the device has run what the engine
    launched (a step launched ahead may still write into pages freed on the host). The READ is posted only then,
    while the engine thread goes on stepping other requests; a failed wait fails the transfer cleanly and ends the
    lease. There is no GPU here, so the event is a stand-in injected into the decode engine's process."""
    host = ray.get(tiny.decode.handle.__ray_call__.remote(lambda r: r.group.host))
    reference = tiny.generate(requests(TINY_PROMPTS[2:3], tag=f"settle-ref-{fail}"))[0]
    read_before = hold_stats(tiny)["read"]
    ticket, busy = tiny.prefill_all(requests(TINY_PROMPTS[2:3], tag=f"settle-{fail}")
                                    + requests([[(5 * j) % 120 + 1 for j in range(9)]], 480, f"busy-{fail}"))
    steps = tiny.decode.handle.decode.options(num_returns="streaming").remote(busy)
    busy_chunks = [ray.get(next(steps))]         # decoding (its own reservation came before the stand-in)
    arrivals = []

    def follow_busy():
        for ref in steps:
            busy_chunks.append(ray.get(ref))
            arrivals.append(time.monotonic())

    follower = threading.Thread(target=follow_busy)
    ray.get(host.__ray_call__.remote(_settle_slowly, 1.5, fail))
    try:
        follower.start()
        start = time.monotonic()
        chunks = decode_chunks(tiny.decode, ticket)
        follower.join(60)
    finally:
        ray.get(host.__ray_call__.remote(_settle_at_once))
    assert busy_chunks[-1]["finished"] and sum(len(c["token_ids"]) for c in busy_chunks) == 480
    if fail:
        assert [c["type"] for c in chunks] == ["error"] and chunks[0]["error_type"] == "transfer_error", chunks
        assert "waiting for the device before the READ failed" in chunks[0]["message"]
        wait_until(lambda: tiny.prefill.pages_in_use() == 0, 5)       # the lease ended, not left to time out
        assert hold_stats(tiny)["read"] == read_before + 2
        return
    transfer = chunks[0]["transfer"]
    assert transfer["settle_s"] >= 1.4 > transfer["read_s"], transfer      # posted after the wait, not before it
    # The engine thread stepped the other request on while the READ waited.
    assert any(start + 0.3 < t < start + 1.2 for t in arrivals), [round(t - start, 2) for t in arrivals]
    assert sum((c["token_ids"] for c in chunks), []) == reference.token_ids


def test_failed_transfer_fails_the_request_and_frees_both_sides(tiny):
    """The decode side registers the prefill peer with descriptors that point outside its registered memory
    (as after the peer re-registered its pool): NIXL itself refuses the READ."""
    # One request first, so the decode replica knows the peer and will not register it again from a ticket.
    decode_chunks(tiny.decode, tiny.prefill_all(requests(TINY_PROMPTS[:1], tag="known-peer"))[0])
    kvm = ray.get(tiny.decode.handle.kv_managers.remote())[0]
    payload = ray.get(tiny.prefill.handle.rank_infos.remote())[0]
    stale = json.loads(payload)
    for group in stale["groups"]:
        group["base_address"] += 1 << 40
    ray.get(kvm.register_peer.remote(json.dumps(stale)))
    read_before = hold_stats(tiny)["read"]
    try:
        ticket = tiny.prefill_all(requests(TINY_PROMPTS[1:2], tag="fail"))[0]
        chunks = decode_chunks(tiny.decode, ticket)
    finally:
        ray.get(kvm.register_peer.remote(payload))
    assert [c["type"] for c in chunks] == ["error"] and chunks[0]["error_type"] == "transfer_error"
    assert "fail-0" in chunks[0]["message"] and "could not start" in chunks[0]["message"]
    assert tiny.decode.pages_in_use() == 0
    # Freed as the READ ended, long before the 30 s hold would expire.
    wait_until(lambda: tiny.prefill.pages_in_use() == 0, 5)
    assert hold_stats(tiny)["read"] == read_before + 1


def test_a_table_outside_the_pool_fails_after_the_lease_check_and_ends_the_lease(tiny):
    """The reader plans while its lease check is in flight; a table outside its pool fails the READ only after
    that check, so the lease is ended (not left to expire) and the prefill pages go back at once."""
    decode_chunks(tiny.decode, tiny.prefill_all(requests(TINY_PROMPTS[:1], tag="bad-table-peer"))[0])
    kvm = ray.get(tiny.decode.handle.kv_managers.remote())[0]
    read_before = hold_stats(tiny)["read"]
    ticket = tiny.prefill_all(requests(TINY_PROMPTS[1:2], tag="bad-table"))[0]
    beyond = [[10 ** 6 + i for i in range(len(table))] for table in ticket.tables]
    with pytest.raises(ray.exceptions.RayTaskError, match="page 1000000 is outside space 0"):
        ray.get(kvm.read.remote(ticket.leases[0], ticket.peer_agents[0], ticket.tables, beyond))
    wait_until(lambda: tiny.prefill.pages_in_use() == 0, 5)
    assert hold_stats(tiny)["read"] == read_before + 1


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
    agg = demo.generate(reqs)
    disagg, _ = run_disaggregated(demo.prefill, demo.decode, reqs)
    assert [o.token_ids for o in disagg] == [o.token_ids for o in agg]
    assert [o.acceptance_lengths for o in disagg] == [o.acceptance_lengths for o in agg]
    assert sum(o.mean_acceptance_length for o in agg) / len(agg) > 2.0     # a trained drafter, not a random one


def test_demo_ablation_lowers_acceptance_and_stays_lossless(demo):
    reqs = demo_requests("demo-ablate")
    agg = demo.generate(reqs)
    ablated, _ = run_disaggregated(demo.prefill, demo.ablated, reqs)
    assert [o.token_ids for o in ablated] == [o.token_ids for o in agg]

    def mean_al(outputs):
        drafts = sum(len(o.acceptance_lengths) for o in outputs)
        return sum(sum(o.acceptance_lengths) for o in outputs) / drafts

    assert mean_al(ablated) < mean_al(agg) - 0.05


def test_a_request_id_streaming_on_a_replica_is_refused_to_a_second_request_that_changes_nothing(tiny):
    """A second request with the id of one streaming on the same replica gets a 400 and touches nothing of the first,
    which streams to its end with its solo tokens (the second's stream would otherwise take the first's outputs, and
    its refusal close the first's stream). Aggregated, and decode (whose prefill lease is the first's: left alone)."""
    long = SamplingParams(max_tokens=200, ignore_eos=True)
    solo = tiny.generate([("dup-solo", TINY_PROMPTS[0], long)])[0]
    first = tiny.agg.handle.generate.options(num_returns="streaming").remote("dup-agg", TINY_PROMPTS[0], long)
    chunks = [ray.get(next(first))]          # streaming: the id is in use
    second = [ray.get(r) for r in tiny.agg.handle.generate.options(num_returns="streaming").remote(
        "dup-agg", TINY_PROMPTS[1], long)]
    assert [(c["type"], c["status"]) for c in second] == [("error", 400)] and "already in use" in second[0]["message"]
    chunks += within(lambda: [ray.get(r) for r in first], 60)
    assert [t for c in chunks for t in c["token_ids"]] == solo.token_ids and chunks[-1]["finished"]

    ticket = tiny.prefill_all([("dup-decode", TINY_PROMPTS[0], long)])[0]
    first = tiny.decode.handle.decode.options(num_returns="streaming").remote(ticket)
    chunks = [ray.get(next(first))]
    second = decode_chunks(tiny.decode, ticket)
    assert [(c["type"], c["status"]) for c in second] == [("error", 400)] and "already in use" in second[0]["message"]
    chunks += within(lambda: [ray.get(r) for r in first], 60)
    assert [t for c in chunks for t in c["token_ids"]] == solo.token_ids and chunks[-1]["finished"]


def within(fn, timeout_s: float):
    """``fn()``, failing the test when it has not returned within ``timeout_s`` (a stream that lost its outputs
    would wait forever)."""
    result = queue.Queue()
    threading.Thread(target=lambda: result.put(fn()), daemon=True).start()
    try:
        return result.get(timeout=timeout_s)
    except queue.Empty:
        raise AssertionError(f"no result within {timeout_s} s") from None


def test_a_read_may_overtake_its_hold_and_a_cancel_may_too(tiny):
    """The prefill replica sends the hold and returns the ticket without waiting: the decode side's
    begin_read can arrive first (it waits for the hold), and so can a cancel (the hold is freed on arrival)."""
    kvm = ray.get(tiny.prefill.handle.kv_managers.remote())[0]
    before = ray.get(kvm.hold_stats.remote())
    early_read = kvm.begin_read.remote("overtaken#1", 10.0)
    time.sleep(0.3)
    ray.get(kvm.hold.remote("never-prefilled-a", "overtaken#1", 30.0))
    assert ray.get(early_read) is True
    ray.get(kvm.end_read.remote("overtaken#1"))
    assert ray.get(kvm.cancel.remote("cancelled-first#1")) is False        # its hold has not arrived
    ray.get(kvm.hold.remote("never-prefilled-b", "cancelled-first#1", 30.0))
    after = ray.get(kvm.hold_stats.remote())
    assert (after["held"], after["reading"]) == (0, 0)
    assert (after["read"], after["cancelled"]) == (before["read"] + 1, before["cancelled"] + 1)
    assert ray.get(kvm.begin_read.remote("cancelled-first#1", 10.0)) is False    # released: refused at once


def test_a_reader_forgets_a_peer_whose_kv_manager_died(ray_cluster):
    """A prefill replica replaced or scaled away leaves its KV manager dead: the readers that registered it drop it
    (its NIXL metadata, and on a GPU the mapping of its pools) at their next peer check; live peers stay."""
    from actors.kv_manager import KVManagerActor
    from kv.pool import KVPool
    from kv.spec import LayerOwner, make_layer_specs

    specs = [make_layer_specs(LayerOwner.TARGET, 2, "float32", 2, 16) + make_layer_specs(LayerOwner.DRAFT, 1,
                                                                                            "float32", 2, 16)]
    probe = KVPool(specs[0], 4, 1, device="meta")
    actor = ray.remote(KVManagerActor).options(num_cpus=0)
    managers, infos = [], []
    for name in ("watch-reader", "watch-live", "watch-dies"):
        kvm = actor.remote(name, peer_check_s=0.2)
        for group in probe.groups:
            ray.get(kvm.create_segment.remote(group.page_stride * 8))
        infos.append(ray.get(kvm.attach.remote(specs, 4, [8])))
        managers.append(kvm)
    reader, live, dies = managers
    try:
        ray.get([reader.register_peer.remote(infos[1], live), reader.register_peer.remote(infos[2], dies)])
        time.sleep(1.0)        # five checks: both answer
        assert ray.get(reader.peer_names.remote()) == ["watch-dies", "watch-live"]
        ray.kill(dies)
        wait_until(lambda: ray.get(reader.peer_names.remote()) == ["watch-live"], 10)
        time.sleep(0.5)
        assert ray.get(reader.peer_names.remote()) == ["watch-live"]
    finally:
        for kvm in managers:
            ray.kill(kvm)


def test_replica_processes_freeze_their_startup_heap(tiny):
    """The model, its pools and the libraries live as long as the process: frozen after start-up, so that the
    collector's full passes (tens of ms, the engine thread stopped) walk only what serving allocates."""
    for replica in (tiny.agg, tiny.prefill, tiny.decode):
        frozen = ray.get(replica.handle.gc_frozen.remote())
        assert frozen["replica"] > 50_000 and frozen["engine"] > 50_000, frozen
