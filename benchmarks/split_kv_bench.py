"""Split-KV attention per layer as an eager step and as a CUDA graph's step call it, for the tree it runs in.

    python3 benchmarks/split_kv_bench.py                 # on a CUDA machine, from the root of the tree to time
    (cd OLD_TREE && python3 /path/to/benchmarks/split_kv_bench.py --tag old)   # another tree, side by side

An eager step's metadata has ``max_seq_len`` = the batch's longest sequence; a graph's has the whole capacity of a
block table (``--capacity``), because the graph is captured once for every batch it will replay. The kernel's split
of each sequence's keys may depend on either, so both are timed: per case (decode at batch 1-128, ragged batches,
16-token verification blocks; Qwen3-8B heads, page 16, fp8 and bf16 caches), the microseconds per layer in a CUDA
graph over enough layers to stream 512 MB, with the floor of reading the K/V once at the copy bandwidth measured in
the same run, and the relative error against the torch reference. In a tree that has ``max_split_keys`` the graph
column is timed at several values of it too. Trees from before per-sequence splits are timed as their graphs ran
(4 tiles a split, ``decode_split_tiles``).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))

CASES = [("decode b1 1k", [1024], 1), ("decode b1 4k", [4096], 1), ("decode b1 16k", [16384], 1),
         ("decode b8 4k", [4096] * 8, 1), ("decode b32 1k", [1024] * 32, 1), ("decode b32 4k", [4096] * 32, 1),
         ("decode b128 1k", [1024] * 128, 1), ("decode b32 1x16k+31x1k", [16384] + [1024] * 31, 1),
         ("decode b32 1x32k+31x2k", [32768 - 64] + [2048] * 31, 1),
         ("decode b64 ragged 0.5-8k", [512 + (7680 * i) // 63 for i in range(64)], 1),
         ("verify16 b1 1k", [1024], 16), ("verify16 b1 4k", [4096], 16), ("verify16 b4 4k", [4096] * 4, 16)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tag", default="this tree")
    ap.add_argument("--capacity", type=int, default=32768, help="a graph's max_seq_len (block table capacity)")
    ap.add_argument("--max-split-keys", default="2048,4096,8192",
                    help="values timed for the graph column where the tree has max_split_keys")
    args = ap.parse_args()
    import torch
    from attention_check import GPU_SHAPES, Bench, Case, copy_bandwidth, import_attention

    attention, ta = import_attention()
    bench = Bench("cuda", 30)
    bandwidth = copy_bandwidth(bench, torch, "cuda")
    print(f"# {args.tag}: {torch.cuda.get_device_name()}, copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)")
    per_sequence = hasattr(ta, "max_split_tiles_for")
    graph_variants = ([(f"graph {k}", dict(max_split_keys=int(k))) for k in args.max_split_keys.split(",")]
                      if per_sequence else [("graph", {})])
    for dtype in (attention.FP8_DTYPE, torch.bfloat16):
        name = "fp8" if dtype == attention.FP8_DTYPE else "bf16"
        for label, lens, q in CASES:
            per_layer = sum(lens) * 2 * GPU_SHAPES.num_kv_heads * GPU_SHAPES.head_dim * dtype.itemsize
            layers = max(2, min(64, math.ceil(GPU_SHAPES.rotate_bytes / per_layer)))
            case = Case(attention, GPU_SHAPES, [n - q for n in lens], [q] * len(lens), 16, dtype, layers, "cuda")
            case.meta.backend = "torch"
            ref = case.run(attention.paged_attention)
            case.meta.backend = "triton"
            floor = (case.kv_bytes() + case.query.numel() * case.query.element_size()) / bandwidth * 1e6
            cells = []
            for column, kw in [("eager", {})] + graph_variants:
                graph = column.startswith("graph")
                case.meta.max_seq_len = args.capacity if graph else max(lens)
                if not per_sequence:       # the old trees' graphs cut every 4 tiles, their eager decode by the batch
                    case.meta.decode_split_tiles = 4 if graph or q > 1 else None
                out = case.run(ta.decode_attention, **kw)
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                us = bench.graph_ms(case.all_layers(ta.decode_attention, **kw)) / layers * 1e3
                cells.append(f"{column} {us:7.2f} us ({floor / us:4.0%}) err {err:.0e}")
            print(f"{args.tag} {name} {label}: floor {floor:7.2f} | " + " | ".join(cells), flush=True)
            del case
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
