"""Where a decode step's time goes: torch.profiler over a few steps of a random-weight engine (graphed on CUDA,
as ``cuda_graphs: auto`` runs it), or with ``--host`` the host's Python time per function (cProfile; on a GPU
the time the step waits for the device shows up in the one host read, ``tolist``).

python benchmarks/profile_step.py --preset qwen3-8b --device cuda --batch 1 [--host]

With ``--demo`` it is the service's engine instead: the bundled demo pair (target and DFlash drafter, float32,
configured as ``cluster_configs/disagg_1gpu.yaml``'s replicas) in a staggered closed loop of ``--batch`` streams
(``benchmarks/gpu_service.py``'s offline loop: held-out prompts, 64 tokens each, a new request as one ends, as the
HTTP load client feeds a server). It prints the steps' wall times and their wait for the device, each of
``--repeats`` runs, then (``--host``) one more run under cProfile: own time and calls per step of the busiest
functions.

PYTHONPATH=. python benchmarks/profile_step.py --demo --device cuda --batch 16 --host
"""

from __future__ import annotations

import argparse
import time

import torch


def main():
    from benchmarks.engine_bench import PRESETS, make_hf
    from engine import SamplingParams
    from engine.checkpoint import Qwen3Config
    from engine.llm import EngineConfig, build_engine_from_model
    from engine.model import Qwen3Model

    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--host", action="store_true", help="cProfile the host's Python instead of torch.profiler")
    ap.add_argument("--demo", action="store_true", help="the demo pair in a staggered closed loop of --batch streams")
    ap.add_argument("--repeats", type=int, default=3, help="--demo: timed runs before the profiled one")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.demo:
        return demo(args)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    preset = PRESETS[args.preset]
    hf = make_hf(preset, dtype, device)
    cfg = Qwen3Config.from_dict({**preset, "rms_norm_eps": 1e-6, "rope_theta": 1e6})
    model = Qwen3Model(cfg, dict(hf.state_dict()), device, dtype, "random")
    del hf
    engine = build_engine_from_model(model, EngineConfig(model="random", device=args.device,
                                                         dtype=str(dtype).removeprefix("torch."),
                                                         kv_cache_bytes=2 * 2**30))
    for i in range(args.batch):
        engine.add_request(list(range(1, 513)), SamplingParams(max_tokens=4 * args.steps, ignore_eos=True))
    for _ in range(args.steps):          # prefill and warm-up
        engine.step()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    sync()
    print(f"decode step {1e3 * (time.perf_counter() - t) / args.steps:.2f} ms at batch {args.batch}")
    if args.host:
        import cProfile
        import pstats

        with cProfile.Profile() as prof:
            for _ in range(args.steps):
                engine.step()
            sync()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        pstats.Stats(prof).sort_stats("cumtime").print_stats(30)
        return
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                           if device.type == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.steps):
            engine.step()
        sync()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    if device.type == "cuda":
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15))


def demo(args) -> None:
    from benchmarks.gpu_service import (REPO, _prompts_for, closed_loop, demo_llm, format_profiles,
                                        profiled_closed_loop)
    from engine import SamplingParams

    llm = demo_llm(args.device, "float32")
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    prompts = _prompts_for(args.batch, 64, min_requests=4 * args.batch)
    closed_loop(llm, prompts[:args.batch], params, args.batch, stagger=True)       # warm-up: graphs, caches
    print(f"demo pair, {args.device}, {REPO.name}, staggered closed loop of {args.batch} streams, "
          f"{len(prompts)} requests of 64 tokens")
    for _ in range(args.repeats):
        row = closed_loop(llm, prompts, params, args.batch, stagger=True)
        print(f"  {row['output_throughput']:.0f} tok/s; steps that computed a prompt {row['prefill_steps']}, "
              f"p50 {row['prefill_step_ms_p50']:.3f} ms; the others {row['decode_steps']}, "
              f"p50 {row['decode_step_ms_p50']:.3f} ms; waiting for the device {row['device_wait_ms']:.3f} ms a step")
    if args.host:
        print(format_profiles([profiled_closed_loop(llm, prompts, params, args.batch)]))


if __name__ == "__main__":
    main()
