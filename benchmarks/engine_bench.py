"""Engine throughput against transformers' generate on the same weights, in one run.

CPU:  python benchmarks/engine_bench.py --preset tiny
GPU:  python benchmarks/engine_bench.py --preset qwen3-8b --device cuda --batches 1,8,32,128   (random bf16 weights)

Prints prefill and decode tokens/s per batch for both, their ratio, and the decode step time against the floor
of reading the weights and the KV once at the copy bandwidth measured here. ``--modes`` lists engines to run side
by side as ``graphs/overlap`` pairs (``cuda_graphs`` and ``overlap`` settings); on CUDA by default eager, graphed,
and graphed with the decode steps launched ahead of the host (``off/off,on/off,on/on``); a third field ``torch``
(``on/on/torch``) keeps every linear on cuBLAS, without the few-row Triton kernel (``triton_ops.linear``);
``fused`` and ``unfused`` keep that kernel with the layers' norms, residual adds and SwiGLU folded into it or as
kernels of their own (``triton_ops.FUSED_LAYERS``; ``triton``, or no third field, takes its default); with
``--repeats N`` they take turns N times per batch and the step time is the median. ``--profile`` then prints, for
each mode's decode step, the kernels a step launches, the GPU's busy time against the step's wall time, and the top
kernels.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

PRESETS = {
    "tiny": dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, max_position_embeddings=2048),
    "qwen3-8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192),
}


@contextlib.contextmanager
def linears(mode: tuple[str, ...]):
    """While a mode's engine captures or runs: the few-row linear kernel off (every linear on cuBLAS) for
    ``.../torch``, the layers' elementwise work folded into it for ``.../fused`` and in kernels of its own for
    ``.../unfused`` (``unfused:32``: the few-row kernel up to 32 rows, ``triton_ops.SKINNY_MAX_ROWS``); a fourth
    field ``pdl`` or ``serial`` launches the Triton kernels programmatically dependent
    or one after another (``triton_attention.PDL``; by default, dependent where the GPU has it), ``pdl-noprefetch``
    dependent without the linears' weight prefetch (``triton_ops.PREFETCH_STAGES``)."""
    from engine import triton_attention, triton_ops

    linear, launch = (mode[2:3] or ("triton",))[0], mode[3:]
    linear, _, max_rows = linear.partition(":")
    if (linear not in ("triton", "torch", "fused", "unfused") or not (max_rows or "0").isdigit()
            or launch not in ((), ("pdl",), ("serial",), ("pdl-noprefetch",))):
        raise SystemExit(f"unknown setting in mode {'/'.join(mode)}: linears triton, torch, fused or unfused "
                         f"(and :ROWS, the most rows the few-row kernel takes), launches pdl, pdl-noprefetch or serial")
    rows, fused, pdl, prefetch = (triton_ops.SKINNY_MAX_ROWS, triton_ops.FUSED_LAYERS, triton_attention.PDL,
                                  triton_ops.PREFETCH_STAGES)
    triton_ops.SKINNY_MAX_ROWS = 0 if linear == "torch" else int(max_rows or rows)
    triton_ops.FUSED_LAYERS = {"fused": True, "unfused": False}.get(linear, fused)
    triton_attention.PDL = {("serial",): False}.get(launch, True if launch else pdl)
    triton_ops.PREFETCH_STAGES = 0 if launch == ("pdl-noprefetch",) else prefetch
    try:
        yield
    finally:
        (triton_ops.SKINNY_MAX_ROWS, triton_ops.FUSED_LAYERS, triton_attention.PDL,
         triton_ops.PREFETCH_STAGES) = rows, fused, pdl, prefetch


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device) -> float:
    """Bytes/s of a large device copy (read + write counted), the memory floor's yardstick."""
    n = 2 * 2**30 if device.type == "cuda" else 256 * 2**20
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    sync(device)
    t = time.perf_counter()
    for _ in range(5):
        b.copy_(a)
    sync(device)
    return 2 * n * 5 / (time.perf_counter() - t)


def make_hf(preset: dict, dtype, device):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**preset, tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=1e6)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(dtype).eval()
    return model


def time_engine(engine, prompts, n_out):
    from engine import SamplingParams

    device = engine.model.device
    params = SamplingParams(max_tokens=n_out, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in prompts]
    sync(device)
    t0 = time.perf_counter()
    while any(not r.output_token_ids for r in reqs):
        engine.step()
    sync(device)
    t1 = time.perf_counter()
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    sync(device)
    t2 = time.perf_counter()
    return t1 - t0, (t2 - t1) / max(steps, 1), steps


def time_hf(model, prompts, n_out):
    ids = torch.tensor(prompts, device=model.device)
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids[:, :8], max_new_tokens=2, min_new_tokens=2, **kwargs)    # warm-up
        sync(model.device)
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
        sync(model.device)
        t1 = time.perf_counter()
        model.generate(ids, max_new_tokens=n_out, min_new_tokens=n_out, **kwargs)
        sync(model.device)
        t2 = time.perf_counter()
    prefill = t1 - t0
    return prefill, (t2 - t1 - prefill) / (n_out - 1)


def profile_decode(engine, prompts, n_out, steps=4):
    """Kernels per decode step, their summed time against the step's wall time, and the costliest kernels."""
    from engine import SamplingParams

    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=n_out, ignore_eos=True))
    for _ in range(4):                        # prefill and a few decode steps first
        engine.step()
    sync(engine.model.device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync(engine.model.device)
        wall = (time.perf_counter() - t) / steps
    while engine.has_unfinished():
        engine.step()
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.self_device_time_total for e in kernels) / 1e3 / steps
    count = sum(e.count for e in kernels) / steps
    print(f"batch {len(prompts)}: step {wall * 1e3:.2f} ms wall, {count:.0f} kernels, GPU busy {busy:.2f} ms "
          f"({busy / (wall * 1e3):.0%})")
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:12]:
        print(f"  {e.self_device_time_total / 1e3 / steps:8.3f} ms  x{e.count // steps:<4} {e.key[:110]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--out-len", type=int, default=32)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--json", default=None)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (both engines)")
    ap.add_argument("--modes", default=None,
                    help="graphs/overlap pairs to run side by side (default: off/off,on/off,on/on on CUDA, "
                         "off/off,off/on on CPU)")
    ap.add_argument("--repeats", type=int, default=1, help="passes per batch, the modes taking turns; medians")
    ap.add_argument("--profile", action="store_true", help="profile each mode's decode step at each batch")
    args = ap.parse_args()
    device = torch.device(args.device)
    modes = [tuple(m.split("/")) for m in
             (args.modes or ("off/off,on/off,on/on" if device.type == "cuda" else "off/off,off/on")).split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    preset = PRESETS[args.preset]
    hf = make_hf(preset, dtype, device)
    with tempfile.TemporaryDirectory() as tmp:
        if device.type == "cpu":
            hf.save_pretrained(tmp)
        from engine import LLM
        from engine.checkpoint import Qwen3Config
        from engine.llm import EngineConfig, build_engine_from_model
        from engine.model import Qwen3Model

        max_seqs = max(64, max(batches))
        engines = {}
        model = None
        for mode in modes:
            graphs, overlap = mode[:2]
            if device.type == "cpu":
                engines[mode] = LLM(tmp, dtype=str(dtype).removeprefix("torch."), max_num_batched_tokens=8192,
                                    max_num_seqs=max_seqs, page_size=16, cuda_graphs=graphs, overlap=overlap).engine
            else:
                # Share transformers' weights instead of writing 16 GB to disk, and one model among the modes'
                # engines (it holds no engine's state): a model each (its fused projections are copies) left an
                # 80 GB GPU too little for transformers' batch of 128.
                if model is None:
                    cfg = Qwen3Config.from_dict({**preset, "rms_norm_eps": 1e-6, "rope_theta": 1e6})
                    model = Qwen3Model(cfg, dict(hf.state_dict()), device, dtype, "random")
                with linears(mode):
                    engines[mode] = build_engine_from_model(
                        model, EngineConfig(model="random", device=args.device,
                                            dtype=str(dtype).removeprefix("torch."), max_num_batched_tokens=8192,
                                            max_num_seqs=max_seqs, kv_cache_bytes=8 * 2**30, cuda_graphs=graphs,
                                            overlap=overlap))
        bw = copy_bandwidth(device)
        weight_bytes = sum(t.numel() * t.element_size() for t in hf.state_dict().values())
        c = preset
        kv_bytes_per_token = 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * dtype.itemsize
        results = []
        for batch in batches:
            g = torch.Generator().manual_seed(batch)
            prompts = torch.randint(0, c["vocab_size"], (batch, args.prompt_len), generator=g).tolist()
            if device.type == "cuda":
                torch.cuda.empty_cache()    # the engines' freed activations, for transformers' prefill
            try:
                h_prefill, h_step = time_hf(hf, prompts, args.out_len)
            except torch.OutOfMemoryError:
                print(f"batch {batch}: transformers ran out of device memory; its columns are nan")
                h_prefill = h_step = float("nan")
                torch.cuda.empty_cache()
            ctx = args.prompt_len + args.out_len // 2
            # Bytes read over the copy bandwidth, which counts read + write: a copy moves twice the bytes it
            # reads, so read-only traffic streams at about that rate (half of it made the floor twice too long).
            floor = (weight_bytes + batch * ctx * kv_bytes_per_token) / bw
            for mode, engine in engines.items():
                # Warm-up at this batch's full shapes: the first prefill of a shape compiles kernels and grows the
                # caching allocator, which would otherwise land in the timed prefill of whichever engine runs first.
                # Other token ids, so that the timed prompts find nothing in the prefix cache.
                with linears(mode):
                    time_engine(engine, [[(t + 1) % c["vocab_size"] for t in p] for p in prompts], 2)
            timings = {mode: [] for mode in engines}
            for rep in range(args.repeats):
                for mode, engine in engines.items():
                    # Each pass's prompts differ in their first token: no pass reuses another's prefix.
                    with linears(mode):
                        timings[mode].append(time_engine(engine, [[(p[0] + 2 + rep) % c["vocab_size"]] + p[1:]
                                                                  for p in prompts], args.out_len))
            for mode in engines:
                e_prefill = statistics.median(t[0] for t in timings[mode])
                e_step = statistics.median(t[1] for t in timings[mode])
                row = dict(batch=batch, graphs=mode[0], overlap=mode[1], linears="/".join(mode[2:]) or "triton",
                           engine_prefill_tok_s=batch * args.prompt_len / e_prefill,
                           hf_prefill_tok_s=batch * args.prompt_len / h_prefill,
                           engine_decode_tok_s=batch / e_step, hf_decode_tok_s=batch / h_step,
                           engine_step_ms=e_step * 1e3, hf_step_ms=h_step * 1e3, floor_step_ms=floor * 1e3,
                           step_ms_passes=[t[1] * 1e3 for t in timings[mode]])
                row["prefill_ratio"] = row["engine_prefill_tok_s"] / row["hf_prefill_tok_s"]
                row["decode_ratio"] = row["engine_decode_tok_s"] / row["hf_decode_tok_s"]
                row["floor_over_engine"] = floor / e_step
                results.append(row)
            if args.profile and device.type == "cuda":
                for mode in modes:
                    print(f"mode {'/'.join(mode)}:")
                    with linears(mode):
                        profile_decode(engines[mode], prompts, args.out_len)
    print(f"device {device} dtype {dtype} preset {args.preset}: weights {weight_bytes / 2**30:.2f} GiB, "
          f"copy bandwidth {bw / 1e9:.0f} GB/s (read+write)")
    print(f"{'batch':>5} {'graphs':>6} {'overlap':>7} {'linears':>14} {'prefill tok/s':>14} {'hf':>10} {'ratio':>6} "
          f"{'decode tok/s':>13} {'hf':>10} "
          f"{'ratio':>6} "
          f"{'step ms':>8} {'hf ms':>8} {'floor ms':>9} {'floor/step':>10}")
    for r in results:
        print(f"{r['batch']:>5} {r['graphs']:>6} {r['overlap']:>7} {r['linears']:>14} "
              f"{r['engine_prefill_tok_s']:>14.0f} "
              f"{r['hf_prefill_tok_s']:>10.0f} "
              f"{r['prefill_ratio']:>6.2f} {r['engine_decode_tok_s']:>13.0f} {r['hf_decode_tok_s']:>10.0f} "
              f"{r['decode_ratio']:>6.2f} {r['engine_step_ms']:>8.2f} {r['hf_step_ms']:>8.2f} "
              f"{r['floor_step_ms']:>9.3f} {r['floor_over_engine']:>10.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
