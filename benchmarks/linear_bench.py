"""Few-row linears on a GPU: cuBLAS (``F.linear``) against the Triton kernel the engine takes for them
(``engine.triton_ops.skinny_linear``), each against the bytes floor, side by side in one run:

    python3 benchmarks/linear_bench.py                     # Qwen3-8B shapes, bf16, rows 1 / 4 / 8 / 16

Per weight shape of a Qwen3-8B layer (fused qkv, o, fused gate_up, down), its LM head and a 5-layer DFlash
drafter's context projection, and per row count: the time of one product (CUDA-graph replays over enough copies
of the weight to stream 768 MB, so the L2 cache does not hold it), and the floor = weight + input bytes over the
device-to-device copy bandwidth measured in the same run (which counts bytes read plus bytes written). Then the
sum over one decoder layer's four products. Every Triton result is checked against cuBLAS's (to bf16 rounding).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
          "lm_head": (151936, 4096), "drafter_fc": (4096, 5 * 4096)}
LAYER = ("qkv", "o", "gate_up", "down")


def copy_bandwidth() -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        b.copy_(a)
    end.record()
    torch.cuda.synchronize()
    return 2 * a.numel() * 10 / (start.elapsed_time(end) / 1e3)


def graph_us(fn, replays: int = 20) -> float:
    """Microseconds per replay of a CUDA graph of ``fn``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays * 1e3


def main() -> None:
    from engine import triton_ops

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,8,16")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s (read + write), {args.dtype}")
    print(f"{'weight':>10} {'rows':>4} {'floor us':>9} {'cuBLAS us':>10} {'of floor':>8} {'Triton us':>10} "
          f"{'of floor':>8} {'cuBLAS / Triton':>15}")
    rows_list = [int(r) for r in args.rows.split(",")]
    results = []
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        size = n * k * dtype.itemsize
        weights = [torch.randn(n, k, dtype=dtype, device="cuda") / 64 for _ in range(max(1, (768 << 20) // size))]
        for rows in rows_list:
            x = torch.randn(rows, k, dtype=dtype, device="cuda")
            floor = (size + x.numel() * dtype.itemsize) / bw * 1e6
            want = F.linear(x, weights[0])
            got = triton_ops.skinny_linear(x, weights[0])
            torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-3)
            cublas = graph_us(lambda: [F.linear(x, w) for w in weights]) / len(weights)
            triton = graph_us(lambda: [triton_ops.skinny_linear(x, w) for w in weights]) / len(weights)
            results.append(dict(weight=name, rows=rows, floor_us=floor, cublas_us=cublas, triton_us=triton))
            print(f"{name:>10} {rows:>4} {floor:>9.1f} {cublas:>10.1f} {floor / cublas:>8.2f} {triton:>10.1f} "
                  f"{floor / triton:>8.2f} {cublas / triton:>15.2f}")
        weights.clear()
        torch.cuda.empty_cache()
    for rows in rows_list:
        layer = [r for r in results if r["rows"] == rows and r["weight"] in LAYER]
        if len(layer) == len(LAYER):
            floor, cublas, triton = (sum(r[key] for r in layer) for key in ("floor_us", "cublas_us", "triton_us"))
            print(f"one layer's four products, {rows} rows: cuBLAS {cublas:.1f} us ({floor / cublas:.2f} of the "
                  f"floor), Triton {triton:.1f} us ({floor / triton:.2f}), cuBLAS / Triton {cublas / triton:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
