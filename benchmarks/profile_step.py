"""Where a decode step's time goes: torch.profiler over a few steps of a random-weight engine (graphed on CUDA,
as ``cuda_graphs: auto`` runs it), or with ``--host`` the host's Python time per function (cProfile; on a GPU
the time the step waits for the device shows up in the one host read, ``tolist``).

python benchmarks/profile_step.py --preset qwen3-8b --device cuda --batch 1 [--host]
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
    args = ap.parse_args()
    torch.set_num_threads(1)
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


if __name__ == "__main__":
    main()
