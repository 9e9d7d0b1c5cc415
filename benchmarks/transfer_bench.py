"""Disaggregation benchmark: NIXL page READ bandwidth, TTFT aggregated vs disaggregated, and the AL table.

    .venv/bin/python benchmarks/transfer_bench.py [--model DIR --draft DIR] [--pages 256] [--json OUT]

Without --model it uses the demo pair when present, else tiny random checkpoints (AL ~1.0: labelled so).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import ray
import torch

from actors.kv_manager import KVManagerActor
from actors.nixl_transfer import coalesce_arrays
from actors.offline import ReplicaActor, encode_prompts, run_disaggregated
from actors.replica import AggregatedReplica, DecodeReplica, PrefillReplica
from engine.llm import EngineConfig
from engine.sequence import SamplingParams
from kv.pool import KVPool
from kv.spec import LayerOwner, make_layer_specs

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "models" / "demo"
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village,",
           "List three prime numbers:", "The quick brown fox", "import numpy as np\n"]
LAYOUTS = {"fp8-bf16": ("fp8", "bf16"), "bf16-bf16": ("bf16", "bf16")}
# Counted from actors/replica.py, actors/engine_host.py and actors/kv_manager.py as they are.
RAY_CALLS_DETAIL = (
    "per transferred request, in the transfer: 3 Ray calls. The decode replica's engine process calls, at once, "
    "its KV manager's read (which posts the NIXL READ) and the prefill KV manager's begin_read, awaits both, "
    "and then sends the prefill KV manager end_read without waiting for it. The transfer reports the NIXL READ "
    "alone as 'seconds' and the begin_read round trip, which runs alongside it, as 'lease_seconds'. Around the transfer (not counted): "
    "driver -> prefill replica prefill, prefill replica -> its KV manager hold (sent, not awaited), driver -> decode replica "
    "decode (a streaming call whose chunks return as generator items), the prefill replica's pending "
    "wait_released returning (then re-issued), and register_peer once per new prefill peer; each replica's "
    "commands to its engine process over their local socket, not Ray (prefill: start, release; decode: "
    "stand_by, which reserves the pages, then the ticket, and it READs them and starts decoding in that process). "
    "One socket message per engine step from each engine process to its replica, whatever the batch.")


def ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def median_ms(values) -> float:
    return ms(statistics.median(values))


class BenchKVManager(KVManagerActor):
    """The KV manager plus what only this benchmark asks of it: fill its pool bytes and sum some pages'."""

    def set_poll(self, max_s: float) -> None:
        self.endpoint.poll_max_s = max_s

    def set_max_descriptor_bytes(self, size: int) -> None:
        self.endpoint.max_descriptor_bytes = size

    def use_mapping(self, peer_name: str, on: bool) -> bool:
        """Copy from a mapped peer (on) or READ it with NIXL (off); False when the peer is not mapped."""
        stash = self.__dict__.setdefault("_unmapped", {})
        if on and peer_name in stash:
            self.endpoint.mapped[peer_name] = stash.pop(peer_name)
        elif not on and peer_name in self.endpoint.mapped:
            stash[peer_name] = self.endpoint.mapped.pop(peer_name)
        return peer_name in self.endpoint.mapped or peer_name in stash

    async def write(self, peer_name: str, local_tables: list[list[int]], remote_tables: list[list[int]]) -> dict:
        """WRITE our pages into a registered peer's (no lease: the benchmark owns both pools)."""
        start = time.perf_counter()
        nbytes, descriptors = await self.endpoint.read(peer_name, remote_tables, local_tables,
                                                       (LayerOwner.TARGET, LayerOwner.DRAFT), 60.0, op="WRITE")
        return {"bytes": nbytes, "descriptors": descriptors, "seconds": time.perf_counter() - start}

    def time_copies(self, peer_name: str, remote_tables: list[list[int]], local_tables: list[list[int]],
                    repeats: int) -> float:
        """Median host seconds to launch a mapped peer's copies as a READ does (planned first), back to back in
        this actor (the device drained between launches): their cost with warm caches, against the one-off
        launch inside a READ."""
        from actors.nixl_transfer import copy_regions

        plan = self.endpoint.plan(peer_name, remote_tables, local_tables, (LayerOwner.TARGET, LayerOwner.DRAFT))
        segments = self.endpoint.mapped[peer_name].segments
        cuda, stream = self.endpoint._cuda, torch.cuda.current_stream().cuda_stream
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            start = time.perf_counter()
            if plan.copies is not None:
                cuda.copy_all(plan.copies, stream)
            else:
                copy_regions(plan.local, plan.remote, self.endpoint._segments, segments,
                             None if cuda is None else (cuda, stream))
            times.append(time.perf_counter() - start)
        torch.cuda.synchronize()
        return statistics.median(times)

    def fill(self, value: int) -> None:
        for tensor in self.segments.tensors:
            tensor.fill_(value)

    def region_sum(self, tables: list[list[int]]) -> int:
        total = 0
        for pool, table in zip(self.endpoint.pools, tables):
            for group, offset, length in pool.page_regions(table):
                flat = pool.groups[group].buffer.view(-1)
                total += int(flat[offset:offset + length].sum(dtype=torch.int64))
        return total


@ray.remote(num_cpus=0.25)
class ObjectStorePeer:
    """The baseline: a pool buffer whose pages travel through the Ray object store."""

    def __init__(self, nbytes: int, page_stride: int):
        torch.set_num_threads(1)
        self.pages = torch.ones(nbytes // page_stride, page_stride, dtype=torch.uint8)

    def export(self, page_ids):
        return self.pages[torch.tensor(page_ids)]

    def receive(self, pages, page_ids):
        self.pages[torch.tensor(page_ids)] = pages
        return int(pages.numel())


def bandwidth(num_pages: int, repeats: int) -> dict:
    """Moving ``num_pages`` whole pages (8 target FP8 + 1 draft BF16 layer, 8 KV heads x 128) three ways,
    for two page patterns: scattered (every other page: one descriptor per page and group) and contiguous
    (one run of pages: one descriptor per group)."""
    page_size = 16
    specs = [make_layer_specs(LayerOwner.TARGET, 8, "fp8", 8, 128) + make_layer_specs(LayerOwner.DRAFT, 1, "bf16", 8, 128)]
    total_pages = 2 * num_pages
    torch.set_num_threads(1)
    probe = KVPool(specs[0], page_size, total_pages, allocate=lambda n: torch.ones(n, dtype=torch.uint8))
    sizes = [g.buffer.numel() for g in probe.groups]
    nbytes = num_pages * probe.bytes_per_page
    patterns = {
        "scattered": ([list(range(0, total_pages, 2))], [list(range(1, total_pages, 2))]),
        "contiguous": ([list(range(num_pages))], [list(range(num_pages, total_pages))]),
    }
    managers, infos = [], []
    for name in ("bench-src", "bench-dst"):
        kvm = ray.remote(BenchKVManager).options(num_cpus=0.25).remote(name)
        for n in sizes:
            ray.get(kvm.create_segment.remote(n))
        infos.append(ray.get(kvm.attach.remote(specs, page_size, [total_pages])))
        managers.append(kvm)
    src, dst = managers
    ray.get([src.fill.remote(1), dst.fill.remote(0)])
    src_agent = ray.get(dst.register_peer.remote(infos[0], src))
    assert src_agent == json.loads(infos[0])["agent_name"]
    stride = probe.bytes_per_page
    a = ObjectStorePeer.remote(total_pages * stride, stride)
    b = ObjectStorePeer.remote(total_pages * stride, stride)
    # Wait until both have started: a worker process starting up (importing torch) would load the 2 cores.
    ray.get(b.receive.remote(a.export.remote([0]), [0]))

    def row(seconds):
        s = statistics.median(seconds)
        return {"median_ms": ms(s), "GB_per_s": round(nbytes / s / 1e9, 2), "min_ms": ms(min(seconds))}

    results = {}
    lease_ids = 0
    for pattern, (remote, local) in patterns.items():
        ray.get(dst.fill.remote(0))
        # The decode path: the source holds a (dummy) request's pages under a lease, the destination READs
        # under it: one begin_read call to the source (lease_seconds) with the NIXL READ (seconds) alongside.
        read_s, lease_s, call_s, descriptors = [], [], [], set()
        for i in range(repeats + 1):
            lease = ray.get(src.hold.remote(f"bench-{pattern}-{lease_ids}", f"lease-{lease_ids}", 60.0))
            lease_ids += 1
            t0 = time.perf_counter()
            stats = ray.get(dst.read.remote(lease, src_agent, remote, local, True, 60.0))
            call_s.append(time.perf_counter() - t0)
            assert stats["bytes"] == nbytes, stats
            read_s.append(stats["seconds"])
            lease_s.append(stats["lease_seconds"])
            descriptors.add(stats["descriptors"])
        read_s, lease_s, call_s = read_s[1:], lease_s[1:], call_s[1:]   # the first READ also connects UCX
        landed = ray.get(dst.region_sum.remote(local)) == nbytes     # every source byte is 1

        # The same regions as NIXL's descriptors (coalesced the same way), one copy_ each, inside one process.
        src_regions = np.array([(off, n, g) for g, off, n in probe.page_regions(remote[0])], dtype=np.int64)
        dst_regions = np.array([(off, n, g) for g, off, n in probe.page_regions(local[0])], dtype=np.int64)
        dst_desc, src_desc = (rows.tolist() for rows in coalesce_arrays(dst_regions, src_regions))
        flats = [g.buffer.view(-1) for g in probe.groups]
        memcpy_s = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            for (d_off, n, g), (s_off, _, _) in zip(dst_desc, src_desc):
                flats[g][d_off:d_off + n].copy_(flats[g][s_off:s_off + n])
            memcpy_s.append(time.perf_counter() - t0)
        memcpy_s = memcpy_s[1:]

        ray.get(b.receive.remote(a.export.remote(remote[0][:1]), local[0][:1]))
        store_s = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            ray.get(b.receive.remote(a.export.remote(remote[0]), local[0]))
            store_s.append(time.perf_counter() - t0)

        results[pattern] = {
            "descriptors_per_read": sorted(descriptors)[0] if len(descriptors) == 1 else sorted(descriptors),
            "memcpy_copies": len(dst_desc),
            "bytes_landed": landed,
            "nixl_read": row(read_s),                  # read()'s seconds: the NIXL READ alone
            "lease_check_ms": median_ms(lease_s),      # read()'s lease_seconds: begin_read on the source
            "read_call_from_driver_ms": median_ms(call_s),
            "memcpy_same_process": row(memcpy_s),
            "ray_object_store": row(store_s),
            "nixl_read_vs_memcpy_time": round(statistics.median(read_s) / statistics.median(memcpy_s), 2),
        }
    for kvm in managers:
        ray.get(kvm.close.remote())
        ray.kill(kvm)
    for actor in (a, b):
        ray.kill(actor)
    return {"pages": num_pages, "bytes": nbytes, "bytes_per_page": probe.bytes_per_page,
            "groups": len(probe.groups), "patterns": results}


def tiny_pair() -> tuple[str, str]:
    from tests.checkpoints import write_tiny_drafter, write_tiny_qwen3

    root = Path(tempfile.mkdtemp(prefix="dflash-bench-"))
    return str(write_tiny_qwen3(root / "target")), str(write_tiny_drafter(root / "drafter"))


def mean_al(outputs) -> float:
    steps = [al for o in outputs for al in o.acceptance_lengths]
    return round(sum(steps) / len(steps), 3) if steps else float("nan")


def ray_call_ms(make_ref, n: int = 50) -> float:
    ray.get(make_ref())
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        ray.get(make_ref())
        samples.append(time.perf_counter() - t0)
    return median_ms(samples)


def first_chunk(start_stream, what: str) -> tuple[dict, float]:
    """The first chunk of the Ray streaming call ``start_stream()`` makes and the seconds to it; drains the rest."""
    t0 = time.perf_counter()
    stream = start_stream()
    first = ray.get(next(stream))
    seconds = time.perf_counter() - t0
    rest = [ray.get(ref) for ref in stream]
    if first["type"] != "tokens" or any(c["type"] != "tokens" for c in rest):
        raise RuntimeError(f"{what} failed: {first}")
    return first, seconds


def serving(model: str, draft: str, layouts: dict, max_tokens: int, prompts: list[str]) -> dict:
    """Per KV layout: TTFT aggregated vs disaggregated (with the READ's share) and mean AL three ways."""
    results = {}
    try:
        prompt_ids = encode_prompts(model, prompts)
    except ValueError:
        prompt_ids = [[(7 * i + 3 * j) % 120 + 1 for j in range(8 + 9 * i)] for i in range(len(prompts))]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    requests = [(f"r{i}", ids, params) for i, ids in enumerate(prompt_ids)]
    for name, (target_kv, draft_kv) in layouts.items():
        # No prefix cache: every phase below sends the same prompts again, and a cache hit would change what a
        # step computes (a hit that leaves one prompt token even makes the prefill a drafted step with an AL).
        config = EngineConfig(model=model, draft=draft, num_pages=256, kv_cache_dtype=target_kv,
                              draft_kv_cache_dtype=draft_kv, enable_prefix_caching=False)
        replicas = []
        try:
            agg = ReplicaActor(AggregatedReplica, config)
            replicas.append(agg)
            prefill = ReplicaActor(PrefillReplica, config)
            replicas.append(prefill)
            decode = ReplicaActor(DecodeReplica, config)
            replicas.append(decode)
            ablated = ReplicaActor(DecodeReplica, config, transfer_draft_kv=False)
            replicas.append(ablated)
            # Request ids are never reused: a prefill's release (after end_read) is keyed by request id.
            ray.get(agg.handle.generate_all.remote([(f"{name}-warm", *requests[0][1:])]))     # warm up every path
            run_disaggregated(prefill, decode, [(f"{name}-warm", *requests[0][1:])])
            run_disaggregated(prefill, ablated, [(f"{name}-warm-abl", *requests[0][1:])])
            warm = SamplingParams(max_tokens=2, ignore_eos=True)       # and the streaming calls timed below
            first_chunk(lambda: agg.handle.generate.options(num_returns="streaming").remote(
                f"{name}-warm-stream", requests[0][1], warm), "aggregated stream")
            ticket = ray.get(prefill.handle.prefill.remote(f"{name}-warm-stream", requests[0][1], warm))["ticket"]
            first_chunk(lambda: decode.handle.decode.options(num_returns="streaming").remote(ticket), "decode")

            # TTFT, one request at a time. Aggregated: prefill to first token (max_tokens 1) in one replica.
            # Disaggregated: prefill (ticket back at the driver), then the decode stream's first chunk, which
            # comes once the READ has ended and the first token is out.
            first_only = SamplingParams(max_tokens=1, ignore_eos=True)
            two = SamplingParams(max_tokens=2, ignore_eos=True)
            t = {k: [] for k in ("agg", "agg_stream", "dis", "prefill_call", "prefill_in_replica", "first_chunk",
                                 "read", "lease", "bytes", "descriptors")}
            for rid, ids, _ in requests:
                t0 = time.perf_counter()
                ray.get(agg.handle.generate_all.remote([(f"{name}-ttft-agg-{rid}", ids, first_only)]))
                t["agg"].append(time.perf_counter() - t0)
                # The same, streamed with max_tokens 2: the first chunk also waits for the drafter's context
                # store of the prompt, which a max_tokens 1 request skips and every disaggregated prefill does.
                _, seconds = first_chunk(lambda: agg.handle.generate.options(num_returns="streaming").remote(
                    f"{name}-ttft-agg2-{rid}", ids, two), "aggregated stream")
                t["agg_stream"].append(seconds)
                t0 = time.perf_counter()
                result = ray.get(prefill.handle.prefill.remote(f"{name}-ttft-dis-{rid}", ids, two))
                t["prefill_call"].append(time.perf_counter() - t0)
                ticket = result["ticket"]
                first, seconds = first_chunk(lambda: decode.handle.decode.options(num_returns="streaming").remote(
                    ticket), f"decode of {ticket.request_id}")
                if not first.get("transfer"):
                    raise RuntimeError(f"the first decode chunk of {ticket.request_id} has no transfer stats")
                t["dis"].append(t["prefill_call"][-1] + seconds)
                t["prefill_in_replica"].append(ticket.prefill_s)
                t["first_chunk"].append(seconds)
                t["read"].append(first["transfer"]["seconds"])
                t["lease"].append(first["transfer"]["lease_seconds"])
                t["bytes"].append(first["transfer"]["bytes"])
                t["descriptors"].append(first["transfer"]["descriptors"])

            # AL: one request at a time in every mode, so each step runs on the same batch shapes everywhere.
            # (Batched, the aggregated engine mixes decode rows with other prompts' prefill chunks while the
            # decode replica does not; with an FP8 target cache that changes rounding and so tokens.)
            agg_out, agg_wall = [], 0.0
            for rid, ids, p in requests:
                t0 = time.perf_counter()
                agg_out += ray.get(agg.handle.generate_all.remote([(f"{name}-agg-{rid}", ids, p)]))
                agg_wall += time.perf_counter() - t0
            with_draft, dis_wall = [], 0.0
            for rid, ids, p in requests:
                outs, timings = run_disaggregated(prefill, decode, [(f"{name}-dis-{rid}", ids, p)])
                with_draft += outs
                dis_wall += timings.total_s
            without = []
            for rid, ids, p in requests:
                without += run_disaggregated(prefill, ablated, [(f"{name}-abl-{rid}", ids, p)])[0]

            kvm = ray.get(decode.handle.kv_managers.remote())[0]
            steps = sum(len(o.acceptance_lengths) for o in with_draft) or 1
            agg_steps = sum(len(o.acceptance_lengths) for o in agg_out) or 1
            pairs = list(zip(t["dis"], t["agg"]))
            results[name] = {
                "prefix_caching": config.enable_prefix_caching,
                "ttft_ms": {
                    "aggregated": median_ms(t["agg"]), "disaggregated": median_ms(t["dis"]),
                    "aggregated_stream_first_chunk": median_ms(t["agg_stream"]),     # max_tokens 2, streamed
                    "disagg_minus_agg": median_ms([d - a for d, a in pairs]),
                    "disagg_prefill_call": median_ms(t["prefill_call"]),            # driver round trip to a ticket
                    "disagg_prefill_in_replica": median_ms(t["prefill_in_replica"]),  # Ticket.prefill_s
                    "disagg_first_decode_chunk": median_ms(t["first_chunk"]),        # decode call to first chunk
                    "disagg_nixl_read": median_ms(t["read"]),                        # transfer.seconds
                    "disagg_lease_check": median_ms(t["lease"]),                     # transfer.lease_seconds
                    "disagg_decode_side_besides_read": median_ms([f - r for f, r in zip(t["first_chunk"], t["read"])]),
                    "disagg_minus_agg_over_read": round(statistics.median([d - a for d, a in pairs])
                                                        / statistics.median(t["read"]), 1),
                },
                "read_bytes_median": int(statistics.median(t["bytes"])),
                "read_descriptors_median": statistics.median(t["descriptors"]),
                "control_plane_ms": {
                    "ray_call_kv_manager": ray_call_ms(lambda: kvm.ping.remote()),
                    "ray_call_decode_replica": ray_call_ms(lambda: decode.handle.ready.remote()),
                    "agg_run_wall_per_step": ms(agg_wall / agg_steps),       # prefill + decode, per step
                    "disagg_run_wall_per_step": ms(dis_wall / steps),        # prefill + move + decode, per step
                    "ray_calls_per_decode_step": 0,
                    "ray_calls_per_transferred_request": 3,
                    "ray_calls_detail": RAY_CALLS_DETAIL,
                },
                "mean_al": {"aggregated": mean_al(agg_out), "disagg_with_draft_kv": mean_al(with_draft),
                            "disagg_without_draft_kv": mean_al(without)},
                "lossless": {"with_draft_kv": [o.token_ids for o in with_draft] == [o.token_ids for o in agg_out],
                             "without_draft_kv": [o.token_ids for o in without] == [o.token_ids for o in agg_out],
                             "per_step_al_equal": [o.acceptance_lengths for o in with_draft]
                             == [o.acceptance_lengths for o in agg_out]},
            }
        finally:
            for replica in replicas:
                replica.shutdown()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model")
    parser.add_argument("--draft")
    parser.add_argument("--pages", type=int, default=256, help="pages per READ in the bandwidth test")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--prompt-file", help="JSON lines with a 'prompt' field (e.g. benchmarks/prompts/heldout.jsonl)")
    parser.add_argument("--num-prompts", type=int, default=8)
    args = parser.parse_args()
    prompts = PROMPTS
    if args.prompt_file:
        lines = Path(args.prompt_file).read_text().splitlines()
        prompts = [json.loads(line)["prompt"] for line in lines if line.strip()][:args.num_prompts]
    if args.model:
        model, draft, pair = args.model, args.draft, "given"
    elif (DEMO / "target").is_dir() and (DEMO / "drafter").is_dir():
        model, draft, pair = str(DEMO / "target"), str(DEMO / "drafter"), "demo"
    else:
        (model, draft), pair = tiny_pair(), "tiny-random (demo pair missing: AL is not meaningful)"
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}})
    try:
        results = {"pair": pair, "bandwidth": bandwidth(args.pages, args.repeats),
                   "serving": serving(model, draft, LAYOUTS, args.max_tokens, prompts)}
    finally:
        ray.shutdown()
    text = json.dumps(results, indent=1)
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text)


if __name__ == "__main__":
    main()
