"""The engine's GPU tests and benchmarks in one go (issue 12), on one GPU machine (torch only: no Ray, no NIXL),
printing one table at the end:

    python3 benchmarks/gpu_suite.py --out out/gpu_suite                          # over 10 min cold: --only splits it
    .venv/bin/python benchmarks/gpu_suite.py --device cpu --out out/gpu_suite    # the same steps, small, on CPU

Each step runs in a process of its own under a time limit, its whole output kept in ``--out``:

1. ``tests``: the kernel and graph tests on the device (attention, fused layer kernels, CUDA graphs' padding);
2. ``step_check``: ``gpu_step_check.py`` (lossless greedy, one host sync a step, seeded repeats, graphs == eager);
3. ``engine``: ``engine_bench.py``, decode steps eager and graphed against transformers and the memory floor,
   batch 1 / 8 / 32 / 128 (Qwen3-8B shape, random bf16 weights);
4. ``spec``: ``spec_bench.py``, the spec step against a plain one (8B-shaped random pair at batch 1 and 32) and the
   trained demo pair's speedup over its AL;
5. ``attention``: ``attention_check.py --no-sweep``, the kernels against torch and the decode kernels against their
   bytes floor (its tuning sweep, prefetching page ids among it, takes a call of its own);
6. ``split_kv`` (GPU only): ``split_kv_bench.py``, the split-KV kernel as eager steps and CUDA graphs call it;
7. ``linears`` (GPU only): ``linear_bench.py``, the few-row linear kernel against cuBLAS and the bytes floor;
8. ``linears_engine`` (GPU only): ``engine_bench.py`` with the kernel on and the layers' norms, residual adds and
   SwiGLU folded into it, on with them as kernels of their own (the default), and off (every linear on cuBLAS), the
   graphed + overlapped decode step at batch 1 / 8 / 32;
9. ``pdl_engine`` (GPU only): ``engine_bench.py`` with the kernels launched one after another, programmatically
   dependent without the linears' weight prefetch, and with it (the default), the same steps;
10. ``rows_engine`` (GPU only): ``engine_bench.py`` with the few-row kernel up to 16 rows (cuBLAS past them) and
    up to 32 (the default), the graphed + overlapped decode step at batch 24 / 32.

Exits 1 if a step failed. The Ray + NIXL service on the GPU is ``gpu_service.py`` (it needs those wheels).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def steps(device: str, out: Path) -> list[tuple[str, list[str], int]]:
    """(name, command, seconds allowed) per step; CPU runs the same scripts at small sizes."""
    py = [sys.executable]
    gpu = device == "cuda"
    engine = (["--preset", "qwen3-8b", "--device", "cuda", "--prompt-len", "512", "--out-len", "32",
               "--batches", "1,8,32,128", "--repeats", "3"] if gpu
              else ["--preset", "tiny", "--prompt-len", "64", "--out-len", "8", "--batches", "1,4"])
    big = ["--preset", "qwen3-8b", "--device", "cuda", "--repeats", "3"] if gpu else ["--preset", "tiny"]
    return [
        ("tests", py + ["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_attention.py",
                        "tests/test_layer_ops.py", "tests/test_cuda_graphs.py"], 480),   # 287 s cold on an H100
        ("step_check", py + ["benchmarks/gpu_step_check.py", "--device", device], 400),
        ("engine", py + ["benchmarks/engine_bench.py", *engine, "--json", str(out / "engine.json")], 400),
        ("spec_b1", py + ["benchmarks/spec_bench.py", *big, "--num-prompts", "4", "--max-tokens", "64", "--batch", "1",
                          "--json", str(out / "spec_b1.json")], 120),
        ("spec_b32", py + ["benchmarks/spec_bench.py", *big, "--num-prompts", "32" if gpu else "4", "--max-tokens",
                           "48" if gpu else "16", "--batch", "32" if gpu else "4",
                           "--json", str(out / "spec_b32.json")], 120),
        ("spec_demo", py + ["benchmarks/spec_bench.py", "--device", device, "--repeats", "3" if gpu else "1",
                            "--num-prompts", "16" if gpu else "2",
                            "--max-tokens", "128" if gpu else "16", "--json", str(out / "spec_demo.json")], 120),
        ("attention", py + ["benchmarks/attention_check.py", "--no-sweep"] + ([] if gpu else ["--cpu-smoke"]), 240),
    ] + ([("split_kv", py + ["benchmarks/split_kv_bench.py", "--max-split-keys", "2048"], 120),
          ("linears", py + ["benchmarks/linear_bench.py", "--json", str(out / "linears.json")], 120),
          ("linears_engine", py + ["benchmarks/engine_bench.py", "--preset", "qwen3-8b", "--device", "cuda",
                                   "--prompt-len", "512", "--out-len", "32", "--batches", "1,8,32", "--modes",
                                   "on/on/fused,on/on/unfused,on/on/torch", "--repeats", "3",
                                   "--json", str(out / "linears_engine.json")], 360),
          ("pdl_engine", py + ["benchmarks/engine_bench.py", "--preset", "qwen3-8b", "--device", "cuda",
                               "--prompt-len", "512", "--out-len", "32", "--batches", "1,8,32", "--modes",
                               "on/on/unfused/serial,on/on/unfused/pdl-noprefetch,on/on/unfused/pdl", "--repeats",
                               "3", "--json", str(out / "pdl_engine.json")], 360),
          ("rows_engine", py + ["benchmarks/engine_bench.py", "--preset", "qwen3-8b", "--device", "cuda",
                                "--prompt-len", "512", "--out-len", "32", "--batches", "24,32", "--modes",
                                "on/on/unfused:16/pdl,on/on/unfused:32/pdl", "--repeats", "3",
                                "--json", str(out / "rows_engine.json")], 360)] if gpu else [])


def headline(name: str, out: Path) -> str:
    """The figures a step's JSON holds, in a line ('' for steps that only print)."""
    path = out / f"{name}.json"
    if not path.exists():
        lines = (out / f"{name}.log").read_text(errors="replace").splitlines()
        if name == "step_check":
            checks = [line for line in lines if line.startswith("| ") and not line.startswith("| check")]
            return f"{sum('| yes' in c for c in checks)} of {len(checks)} checks passed"
        if name == "tests":
            return next((line.strip("= ") for line in reversed(lines) if " passed" in line or " failed" in line), "")
        return ""
    data = json.loads(path.read_text())
    if name == "linears":
        layer = [r for r in data if r["weight"] in ("qkv", "o", "gate_up", "down")]

        def ratio(rows: int) -> float:
            return (sum(r["cublas_us"] for r in layer if r["rows"] == rows)
                    / sum(r["triton_us"] for r in layer if r["rows"] == rows))
        return "; ".join(f"{rows} rows: layer cuBLAS / Triton {ratio(rows):.3f}"
                         for rows in sorted({r["rows"] for r in layer}))
    if name == "linears_engine":
        step = {(r["batch"], r["linears"]): r["engine_step_ms"] for r in data}
        return "; ".join(f"b{b}: {step[b, 'unfused']:.2f} ms, folded layers / separate kernels "
                         f"{step[b, 'fused'] / step[b, 'unfused']:.3f}, cuBLAS / Triton "
                         f"{step[b, 'torch'] / step[b, 'unfused']:.3f}" for b in sorted({b for b, _ in step}))
    if name == "pdl_engine":
        step = {(r["batch"], r["linears"].split("/")[-1]): r for r in data}
        return "; ".join(f"b{b}: serial {step[b, 'serial']['engine_step_ms']:.2f} ms "
                         f"({step[b, 'serial']['floor_over_engine']:.2f} of floor), dependent "
                         f"{step[b, 'pdl']['engine_step_ms']:.2f} ({step[b, 'pdl']['floor_over_engine']:.2f}), "
                         f"without the prefetch {step[b, 'pdl-noprefetch']['engine_step_ms']:.2f}"
                         for b in sorted({b for b, _ in step}))
    if name == "rows_engine":
        step = {(r["batch"], r["linears"].split("/")[0]): r for r in data}
        return "; ".join(f"b{b}: to 16 rows {step[b, 'unfused:16']['engine_step_ms']:.2f} ms "
                         f"({step[b, 'unfused:16']['floor_over_engine']:.2f} of floor), to 32 rows "
                         f"{step[b, 'unfused:32']['engine_step_ms']:.2f} "
                         f"({step[b, 'unfused:32']['floor_over_engine']:.2f})" for b in sorted({b for b, _ in step}))
    if name == "engine":
        return "; ".join(f"b{r['batch']} {r['graphs']}/{r['overlap']}: {r['engine_step_ms']:.2f} ms, "
                         f"{r['floor_over_engine']:.2f} of floor" for r in data)
    return (f"{data['base']['tokens_per_s']:.0f} -> {data['spec']['tokens_per_s']:.0f} tok/s, speedup "
            f"{data['speedup']:.2f}, AL {data['spec']['mean_al'] or 1:.2f}, "
            f"speedup/AL {data['speedup'] / (data['spec']['mean_al'] or 1):.2f}, greedy identical {data['lossless']}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--out", default="out/gpu_suite")
    p.add_argument("--only", nargs="+", default=None, help="run only these steps")
    args = p.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
               PYTHONUNBUFFERED="1")
    if args.device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    rows = []
    for name, command, limit in steps(args.device, out):
        if args.only and name not in args.only:
            continue
        start = time.monotonic()
        with open(out / f"{name}.log", "w") as log:
            try:
                rc = subprocess.run(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    timeout=limit).returncode
                status = "ok" if rc == 0 else f"FAILED (exit {rc})"
            except subprocess.TimeoutExpired:
                status = f"FAILED (over {limit} s)"
        rows.append((name, status, time.monotonic() - start, headline(name, out)))
        print(f"{name}: {status} in {rows[-1][2]:.0f} s (output: {out / (name + '.log')})", flush=True)
    print(f"\n| step | status | seconds | headline (whole output in {out}) |\n|---|---|---|---|")
    for name, status, seconds, line in rows:
        print(f"| {name} | {status} | {seconds:.0f} | {line} |")
    return 0 if all(status == "ok" for _, status, _, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
