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

import ray
import torch

from actors.kv_manager import KVManagerActor
from actors.offline import encode_prompts, run_disaggregated
from actors.replica import AggregatedReplica, DecodeReplica, PrefillReplica
from engine.llm import EngineConfig
from engine.sequence import SamplingParams
from kv.pool import KVPool
from kv.spec import LayerOwner, make_layer_specs

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "models" / "demo"
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village,",
           "List three prime numbers:", "The quick brown fox", "import numpy as np\n"]


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
    """GB/s of moving ``num_pages`` whole pages (8 target FP8 + 1 draft BF16 layer, 8 KV heads x 128) three ways."""
    page_size = 16
    specs = [make_layer_specs(LayerOwner.TARGET, 8, "fp8", 8, 128) + make_layer_specs(LayerOwner.DRAFT, 1, "bf16", 8, 128)]
    total_pages = 2 * num_pages
    probe = KVPool(specs[0], page_size, total_pages, allocate=lambda n: torch.empty(n, dtype=torch.uint8))
    sizes = [g.buffer.numel() for g in probe.groups]
    ends = []
    for name in ("bench-src", "bench-dst"):
        kvm = ray.remote(KVManagerActor).options(num_cpus=0.25).remote(name)
        for n in sizes:
            ray.get(kvm.create_segment.remote(n))
        info = ray.get(kvm.attach.remote(None, specs, page_size, [total_pages]))
        ends.append((kvm, info))
    (src, src_info), (dst, _) = ends
    peer = ray.get(dst.register_peer.remote(src_info))
    remote = [list(range(0, total_pages, 2))]          # every other page: not one contiguous run
    local = [list(range(1, total_pages, 2))]
    nbytes = num_pages * probe.bytes_per_page
    nixl_s = []
    for i in range(repeats + 1):
        stats = ray.get(dst.read.remote(f"bench-{i}", peer, remote, local))
        nixl_s.append(stats["seconds"])
    nixl_s = nixl_s[1:]                                 # the first READ also connects UCX endpoints

    torch.set_num_threads(1)
    buffers = [g.buffer.view(total_pages, -1) for g in probe.groups]
    for b in buffers:
        b.fill_(1)
    memcpy_s = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        # One copy_ per page region, as NIXL moves one descriptor per page per group (index_put is ~10x slower).
        for b in buffers:
            for s, d in zip(remote[0], local[0]):
                b[d].copy_(b[s])
        memcpy_s.append(time.perf_counter() - t0)

    stride = probe.bytes_per_page
    a, b = ObjectStorePeer.remote(total_pages * stride, stride), ObjectStorePeer.remote(total_pages * stride, stride)
    ray.get(b.receive.remote(a.export.remote(remote[0][:1]), local[0][:1]))
    store_s = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        ray.get(b.receive.remote(a.export.remote(remote[0]), local[0]))
        store_s.append(time.perf_counter() - t0)
    for kvm, _ in ends:
        ray.get(kvm.close.remote())
        ray.kill(kvm)
    for actor in (a, b):
        ray.kill(actor)

    def row(seconds):
        s = statistics.median(seconds)
        return {"median_ms": round(s * 1e3, 3), "GB_per_s": round(nbytes / s / 1e9, 2)}

    return {"pages": num_pages, "bytes": nbytes, "bytes_per_page": probe.bytes_per_page,
            "nixl_read": row(nixl_s), "memcpy_same_process": row(memcpy_s), "ray_object_store": row(store_s)}


def tiny_pair() -> tuple[str, str]:
    from tests.checkpoints import write_tiny_drafter, write_tiny_qwen3

    root = Path(tempfile.mkdtemp(prefix="dflash-bench-"))
    return str(write_tiny_qwen3(root / "target")), str(write_tiny_drafter(root / "drafter"))


def mean_al(outputs) -> float:
    steps = [al for o in outputs for al in o.acceptance_lengths]
    return round(sum(steps) / len(steps), 3) if steps else float("nan")


def serving(model: str, draft: str, layouts: dict, max_tokens: int, prompts: list[str]) -> dict:
    """Per KV layout: TTFT aggregated vs disaggregated (with the transfer's share) and mean AL three ways."""
    results = {}
    try:
        prompt_ids = encode_prompts(model, prompts)
    except ValueError:
        prompt_ids = [[(7 * i + 3 * j) % 120 + 1 for j in range(8 + 9 * i)] for i in range(len(PROMPTS))]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    requests = [(f"r{i}", ids, params) for i, ids in enumerate(prompt_ids)]
    for name, (target_kv, draft_kv) in layouts.items():
        config = EngineConfig(model=model, draft=draft, num_pages=256, kv_cache_dtype=target_kv,
                              draft_kv_cache_dtype=draft_kv)
        agg, prefill, decode = AggregatedReplica(config), PrefillReplica(config), DecodeReplica(config)
        decode.connect(prefill.rank_infos)
        try:
            agg.generate(requests[:1])                              # warm up both paths
            run_disaggregated(prefill, decode, requests[:1])
            # TTFT of one request at a time: aggregated = prefill to first token; disaggregated adds the move.
            first = SamplingParams(max_tokens=1, ignore_eos=True)
            agg_ttft, dis_prefill, dis_move, dis_read = [], [], [], []
            for i, (rid, ids, _) in enumerate(requests):
                t0 = time.perf_counter()
                agg.generate([(f"ttft-{rid}", ids, first)])
                agg_ttft.append(time.perf_counter() - t0)
                _, timings = run_disaggregated(prefill, decode, [(f"ttft-{rid}", ids, params)])
                dis_prefill.append(timings.prefill_s)
                dis_move.append(timings.transfer_s[0])
                dis_read.append(timings.read_s[0])
            # One request at a time in every mode, so each step runs on the same batch shapes everywhere.
            # (Batched, the aggregated engine mixes decode rows with other prompts' prefill chunks while the
            # decode replica does not; with an FP8 target cache that changes rounding and so tokens.)
            agg_out = [agg.generate([r])[0] for r in requests]
            with_draft = [run_disaggregated(prefill, decode, [r])[0][0] for r in requests]
            decode.transfer_draft_kv = False
            without = [run_disaggregated(prefill, decode, [(f"abl-{r}", ids, p)])[0][0] for r, ids, p in requests]
            decode.transfer_draft_kv = True
            pings = {}
            for label, actor in (("worker", decode.group.worker), ("kv_manager", decode.group.kv_manager)):
                samples = []
                for _ in range(50):
                    t0 = time.perf_counter()
                    ray.get(actor.ping.remote())
                    samples.append(time.perf_counter() - t0)
                pings[label] = round(statistics.median(samples) * 1e3, 3)
            steps = sum(len(o.acceptance_lengths) for o in with_draft) or 1
            t0 = time.perf_counter()
            run_disaggregated(prefill, decode, [(f"steps-{r}", ids, p) for r, ids, p in requests])
            per_step = (time.perf_counter() - t0) / steps

            def ms(values):
                return round(statistics.median(values) * 1e3, 2)

            results[name] = {
                "ttft_ms": {"aggregated": ms(agg_ttft), "disaggregated": ms([a + b for a, b in zip(dis_prefill, dis_move)]),
                            "disagg_prefill": ms(dis_prefill), "disagg_transfer": ms(dis_move),
                            "disagg_nixl_read": ms(dis_read)},
                "control_plane_ms": {"ray_call_worker": pings["worker"], "ray_call_kv_manager": pings["kv_manager"],
                                     "disagg_run_wall_per_step": round(per_step * 1e3, 2),   # prefill + move + decode, per step
                                     "ray_calls_per_decode_step": 0, "ray_calls_per_transferred_request": 3},
                "mean_al": {"aggregated": mean_al(agg_out), "disagg_with_draft_kv": mean_al(with_draft),
                            "disagg_without_draft_kv": mean_al(without)},
                "lossless": {"with_draft_kv": [o.token_ids for o in with_draft] == [o.token_ids for o in agg_out],
                             "without_draft_kv": [o.token_ids for o in without] == [o.token_ids for o in agg_out],
                             "per_step_al_equal": [o.acceptance_lengths for o in with_draft]
                             == [o.acceptance_lengths for o in agg_out]},
            }
        finally:
            for replica in (agg, prefill, decode):
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
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        results = {"pair": pair, "bandwidth": bandwidth(args.pages, args.repeats),
                   "serving": serving(model, draft, {"fp8-bf16": ("fp8", "bf16"), "bf16-bf16": ("bf16", "bf16")},
                                      args.max_tokens, prompts)}
    finally:
        ray.shutdown()
    text = json.dumps(results, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)


if __name__ == "__main__":
    main()
