"""GPU check of the paged-attention kernels: Triton vs the torch reference, and decode time vs the bytes floor.

    python3 benchmarks/attention_check.py              # on a CUDA machine (Qwen3-8B attention shapes)
    python3 benchmarks/attention_check.py --cpu-smoke  # tiny shapes under TRITON_INTERPRET=1, to test the script

Decode is memory-bound: its floor is the bytes it must read (every stored K/V token of every sequence once, and
the query) over the device-to-device copy bandwidth measured in the same run, counting bytes read plus bytes
written (a copy streams both; ~4.3 TB/s on an H200). Timings replay a CUDA graph that runs the kernel over several
layers' caches (each layer a slice of one page-major group buffer, as in the engine), so a cache-resident working
set stays out; the launch of each kernel in the graph stays in, as it does in an engine's captured step.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
import traceback
import types
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def import_attention():
    """engine.attention and engine.triton_attention without engine/__init__.py, which loads the whole engine."""
    package = types.ModuleType("engine")
    package.__path__ = [str(REPO / "engine")]
    sys.modules.setdefault("engine", package)
    from engine import attention, triton_attention

    return attention, triton_attention


@dataclass
class Shapes:
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    decode_batches: tuple  # (name, kv length of each sequence, this step's token included; None: random 1k-4k)
    other_page_decode_batches: tuple  # the same, checked and timed at the page sizes after the first
    prefill_batches: tuple  # (name, context lengths, query lengths, causal)
    store_tokens: int
    page_sizes: tuple
    rotate_bytes: int  # each timed graph streams at least this much K/V, several times the 60 MB L2
    reps: int


GPU_SHAPES = Shapes(
    num_q_heads=32, num_kv_heads=8, head_dim=128,  # Qwen3-8B
    decode_batches=tuple((f"b{batch} ctx{ctx // 1024}k", [ctx] * batch) for batch in (1, 8, 32, 128)
                         for ctx in (1024, 4096)) + (("b32 ctx1-4k", None),),
    other_page_decode_batches=(("b1 ctx4k", [4096]), ("b32 ctx4k", [4096] * 32)),
    prefill_batches=(("prefill 2k", [0], [2048], True),
                     ("chunk 2k after 2k", [2048], [2048], True),
                     ("mixed 512 chunk + 31 decode", [1000] + [1023 + 96 * i for i in range(31)], [512] + [1] * 31,
                      True),
                     ("draft block16 x32 ctx2k", [2048] * 32, [16] * 32, False),
                     ("verify 16 b1 ctx1k", [1024], [16], True),
                     ("verify 16 b1 ctx4k", [4096], [16], True),
                     ("verify 16 b32 ctx1k", [1024] * 32, [16] * 32, True),
                     ("draft block16 b1 ctx1k", [1024], [16], False),
                     ("draft block16 b1 ctx4k", [4096], [16], False)),
    store_tokens=2048, page_sizes=(16, 64), rotate_bytes=512 << 20, reps=20)
SMOKE_SHAPES = Shapes(
    num_q_heads=4, num_kv_heads=2, head_dim=32,
    decode_batches=(("b1 ctx40", [40]), ("b3 ragged", [1, 17, 90])),
    other_page_decode_batches=(),
    prefill_batches=(("prefill 48", [0], [48], True), ("chunk 24 after 40", [40], [24], True),
                     ("mixed", [30, 20, 50], [20, 1, 1], True), ("draft block8 x3", [20, 33, 1], [8] * 3, False)),
    store_tokens=48, page_sizes=(16,), rotate_bytes=1 << 16, reps=1)
SWEEP_DEADLINE_S = 150  # the tuning sweeps are optional: skip them when the checks alone took this long


class Bench:
    """Times work on the device (CUDA graph replays) or, in the CPU smoke run, once on the host clock."""

    def __init__(self, device, reps):
        import torch

        self.torch, self.device, self.reps = torch, device, reps

    def graph_ms(self, fn):
        """Median milliseconds of one replay of a graph holding fn (fn warmed up first, so compiles stay out)."""
        torch = self.torch
        if self.device == "cpu":
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        for _ in range(3):
            graph.replay()
        return self._median_ms(graph.replay)

    def eager_ms(self, fn, reps=3):
        if self.device == "cpu":
            return self.graph_ms(fn)
        fn()
        return self._median_ms(fn, reps)

    def _median_ms(self, fn, reps=None):
        torch = self.torch
        times = []
        for _ in range(reps or self.reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)


def copy_bandwidth(bench, torch, device):
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    if device == "cpu":
        return float("nan")
    nbytes = 2 << 30
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    ms = bench.eager_ms(lambda: dst.copy_(src), reps=10)
    return 2 * nbytes / (ms * 1e-3)


class Case:
    """One batch over a group buffer of `layers` layers, each layer's K/V a strided view into it."""

    def __init__(self, attention, shapes, context_lens, q_lens, page_size, cache_dtype, layers, device, causal=True,
                 seed=0):
        import torch

        self.torch = torch
        gen = torch.Generator(device=device).manual_seed(seed)
        self.seq_lens = [c + q for c, q in zip(context_lens, q_lens)]
        pages_per_seq = [math.ceil(n / page_size) for n in self.seq_lens]
        num_pages = sum(pages_per_seq) + 1
        H, D = shapes.num_kv_heads, shapes.head_dim
        self.cache_dtype = cache_dtype
        self.kv_scale = 0.01 if cache_dtype == attention.FP8_DTYPE else 1.0  # amax of N(0,1) data ~ 5 -> 500
        # Head-major pages, as the engine's pools lay them out: [pages, layers, K/V, kv heads, page_size, D].
        self.group = torch.empty((num_pages, layers, 2, H, page_size, D), dtype=cache_dtype, device=device)
        for layer in range(layers):
            for kv in range(2):
                values = torch.randn((num_pages, page_size, H, D), generator=gen, device=device, dtype=torch.bfloat16)
                self.group[:, layer, kv].transpose(1, 2)[:] = attention.quantize_for_cache(values, cache_dtype,
                                                                                          self.kv_scale)
        page_ids = torch.randperm(num_pages, generator=gen, device=device).to(torch.int32)
        block_tables = torch.full((len(self.seq_lens), max(pages_per_seq)), -1, dtype=torch.int32, device=device)
        used = 0
        for b, n in enumerate(pages_per_seq):
            block_tables[b, :n] = page_ids[used:used + n]
            used += n
        query_start_loc = torch.tensor([0] + list(q_lens), device=device).cumsum(0).to(torch.int32)
        num_tokens = sum(q_lens)
        self.query = torch.randn((num_tokens, shapes.num_q_heads, D), generator=gen, device=device,
                                 dtype=torch.bfloat16)
        self.meta = attention.AttentionMetadata(
            query_start_loc=query_start_loc,
            seq_lens=torch.tensor(self.seq_lens, dtype=torch.int32, device=device),
            block_tables=block_tables,
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
            max_query_len=max(q_lens), max_seq_len=max(self.seq_lens), causal=causal)
        self.scale = D ** -0.5
        self.layers = layers
        self.flops = 4 * shapes.num_q_heads * D * sum(
            sum(min(s, s - q + i + 1) if causal else s for i in range(q)) for s, q in zip(self.seq_lens, q_lens))

    def caches(self, layer):
        return self.group[:, layer, 0].transpose(1, 2), self.group[:, layer, 1].transpose(1, 2)

    def kv_bytes(self):
        """Bytes of K and V one layer's attention must read: every stored token of every sequence, once."""
        per_token = 2 * self.group.shape[3] * self.group.shape[5] * self.group.element_size()
        return sum(self.seq_lens) * per_token

    def run(self, fn, layer=0, **kw):
        k_cache, v_cache = self.caches(layer)
        return fn(self.query, k_cache, v_cache, self.meta, self.scale, k_scale=self.kv_scale,
                  v_scale=self.kv_scale, **kw)

    def all_layers(self, fn, **kw):
        return lambda: [self.run(fn, layer, **kw) for layer in range(self.layers)]


def rel_err(torch, out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def decode_case(attention, shapes, seq_lens, page_size, cache_dtype, device):
    """One decode token per sequence, over enough layers that a graph replay streams rotate_bytes of K/V."""
    import torch

    element_size = torch.empty((), dtype=cache_dtype).element_size()
    per_layer = sum(seq_lens) * 2 * shapes.num_kv_heads * shapes.head_dim * element_size
    layers = max(2, min(64, math.ceil(shapes.rotate_bytes / per_layer)))
    return Case(attention, shapes, [n - 1 for n in seq_lens], [1] * len(seq_lens), page_size, cache_dtype,
                layers, device)


def reference(attention, case):
    case.meta.backend = "torch"
    k_cache, v_cache = case.caches(0)
    return attention.paged_attention(case.query, k_cache, v_cache, case.meta, case.scale, case.kv_scale,
                                     case.kv_scale)


def triton_dispatch(attention):
    def fn(query, k_cache, v_cache, meta, scale, **kw):
        meta.backend = "triton"
        return attention.paged_attention(query, k_cache, v_cache, meta, scale, **kw)

    return fn


def import_baseline(path):
    """Another tree's engine/triton_attention.py (e.g. ``git archive <commit> | tar -x -C .old``), timed beside this
    one's kernels case by case in one run (``--baseline``). It uses this tree's engine.attention."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("baseline_triton_attention",
                                                  Path(path) / "engine" / "triton_attention.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def side_by_side(bench, fn, base_fn, rounds=2):
    """(ms of fn, ms of base_fn): graph replays taking turns, the faster of each's rounds (None: no baseline)."""
    times, base_times = [], []
    for _ in range(rounds if base_fn else 1):
        times.append(bench.graph_ms(fn))
        if base_fn:
            base_times.append(bench.graph_ms(base_fn))
    return min(times), (min(base_times) if base_fn else None)


def dtype_name(attention, dtype):
    return "fp8" if dtype == attention.FP8_DTYPE else str(dtype).removeprefix("torch.").replace("bfloat16", "bf16")


def check_decode(attention, ta, shapes, bench, bandwidth, device, torch, rows, tol, base=None):
    rng = torch.Generator().manual_seed(1)
    runs = [(shapes.page_sizes[0], shapes.decode_batches)]
    runs += [(page_size, shapes.other_page_decode_batches) for page_size in shapes.page_sizes[1:]]
    for page_size, batches in runs:
        for cache_dtype in (attention.FP8_DTYPE, torch.bfloat16):
            for name, contexts in batches:
                if contexts is None:
                    contexts = torch.randint(1024, 4097, (32,), generator=rng).tolist()
                label = f"decode {name} p{page_size} {dtype_name(attention, cache_dtype)}"
                try:
                    case = decode_case(attention, shapes, contexts, page_size, cache_dtype, device)
                    ref = reference(attention, case)
                    out = case.run(triton_dispatch(attention))
                    err = rel_err(torch, out, ref)
                    ok = err < tol and not out.isnan().any().item()
                    per = case.layers
                    row = {}
                    if base:
                        row["same_as_base"] = bool((case.run(base.decode_attention) == case.run(ta.decode_attention))
                                                   .all().item())
                    t_triton, t_base = side_by_side(bench, case.all_layers(ta.decode_attention),
                                                    base and case.all_layers(base.decode_attention))
                    t_triton /= per
                    if base:
                        row["base_us"] = t_base / per * 1e3
                    t_varlen = bench.graph_ms(case.all_layers(ta.varlen_attention)) / per
                    case.meta.backend = "torch"
                    t_torch = bench.eager_ms(lambda: reference(attention, case))
                    nbytes = case.kv_bytes() + case.query.numel() * case.query.element_size()
                    rows.append(dict(case=label, ok=ok, err=err, us=t_triton * 1e3, mb=nbytes / 1e6,
                                     floor_us=nbytes / bandwidth * 1e6, varlen_us=t_varlen * 1e3,
                                     torch_us=t_torch * 1e3, gbs=nbytes / (t_triton * 1e-3) / 1e9, **row))
                except Exception:
                    traceback.print_exc()
                    rows.append(dict(case=label, ok=False, err=float("nan")))


def check_prefill(attention, ta, shapes, bench, device, torch, rows, tol, base=None):
    for page_size in shapes.page_sizes:
        for cache_dtype in (torch.bfloat16, attention.FP8_DTYPE):
            for name, contexts, q_lens, causal in shapes.prefill_batches:
                label = f"{name} p{page_size} {dtype_name(attention, cache_dtype)}"
                try:
                    case = Case(attention, shapes, contexts, q_lens, page_size, cache_dtype, 1, device,
                                causal=causal)
                    ref = reference(attention, case)
                    out = case.run(triton_dispatch(attention))
                    err = rel_err(torch, out, ref)
                    ok = err < tol and not out.isnan().any().item()
                    # The kernel the dispatch takes (``paged_attention``), timed beside the baseline tree's same
                    # kernel; the varlen kernel beside the baseline's varlen kernel.
                    split = case.meta.uniform and ta.prefers_split_kv(
                        case.meta.max_query_len, len(case.seq_lens), shapes.num_q_heads, shapes.num_kv_heads,
                        case.query.device)
                    kernel = "decode_attention" if split else "varlen_attention"
                    t, t_base = side_by_side(bench, case.all_layers(getattr(ta, kernel)),
                                             base and case.all_layers(getattr(base, kernel)))
                    t_varlen, t_base_varlen = side_by_side(bench, case.all_layers(ta.varlen_attention),
                                                           base and case.all_layers(base.varlen_attention))
                    t_torch = bench.eager_ms(lambda: reference(attention, case))
                    rows.append(dict(case=label, ok=ok, err=err, us=t * 1e3, torch_us=t_torch * 1e3,
                                     kernel="split" if split else "varlen", varlen_us=t_varlen * 1e3,
                                     tflops=case.flops / (t * 1e-3) / 1e12,
                                     **({"base_us": t_base * 1e3, "base_varlen_us": t_base_varlen * 1e3}
                                        if base else {})))
                except Exception:
                    traceback.print_exc()
                    rows.append(dict(case=label, ok=False, err=float("nan")))


def check_store(attention, shapes, device, torch, rows):
    """Triton store == torch store, bit for bit, over the whole group buffer (slots of -1 included)."""
    gen = torch.Generator(device=device).manual_seed(2)
    num_tokens = shapes.store_tokens
    for page_size in shapes.page_sizes:
        for cache_dtype, scale in ((torch.bfloat16, 1.0), (attention.FP8_DTYPE, 0.013)):
            label = f"store_kv T={num_tokens} p{page_size} {dtype_name(attention, cache_dtype)}"
            try:
                num_pages = math.ceil(num_tokens / page_size) * 2
                key = torch.randn((num_tokens, shapes.num_kv_heads, shapes.head_dim), generator=gen,
                                  device=device, dtype=torch.bfloat16) * 3
                value = torch.randn_like(key) * 3
                slots = torch.randperm(num_pages * page_size, generator=gen, device=device)[:num_tokens]
                slots[::7] = -1
                groups = {}
                # torch on the CPU as well: its rounding was checked against numpy's IEEE arithmetic there.
                for backend, where in (("torch", device), ("triton", device), ("torch", "cpu")):
                    group = torch.zeros((num_pages, 3, 2, shapes.num_kv_heads, page_size, shapes.head_dim),
                                        dtype=cache_dtype, device=where)      # head-major pages
                    attention.store_kv(key.to(where), value.to(where), group[:, 1, 0].transpose(1, 2),
                                       group[:, 1, 1].transpose(1, 2),
                                       slots.to(where), scale, scale, backend=backend)
                    groups[backend, where] = group.view(torch.uint8).cpu()
                mismatched = (groups["torch", device] != groups["triton", device]).sum().item()
                vs_cpu = (groups["torch", "cpu"] != groups["triton", device]).sum().item()
                rows.append(dict(case=label, ok=mismatched == 0 and vs_cpu == 0, err=float(mismatched),
                                 vs_cpu=float(vs_cpu)))
                if mismatched or vs_cpu:
                    show_store_mismatches(attention, key, value, page_size, cache_dtype, scale, device, torch)
            except Exception:
                traceback.print_exc()
                rows.append(dict(case=label, ok=False, err=float("nan")))


def show_store_mismatches(attention, key, value, page_size, cache_dtype, scale, device, torch):
    """Print the first disagreeing elements of triton vs torch (device and CPU), with identity slots."""
    num_tokens = key.shape[0]
    slots = torch.arange(num_tokens, device=device)
    stored = {}
    for backend, where in (("torch", device), ("triton", device), ("torch", "cpu")):
        k_cache = torch.zeros((math.ceil(num_tokens / page_size), page_size, *key.shape[1:]), dtype=cache_dtype,
                              device=where)
        v_cache = torch.zeros_like(k_cache)
        attention.store_kv(key.to(where), value.to(where), k_cache, v_cache, slots.to(where), scale, scale,
                           backend=backend)
        stored[backend, where] = k_cache.view(torch.uint8).flatten()[: key.numel()].cpu()
    flat = key.flatten().cpu()
    bad = ((stored["torch", device] != stored["triton", device]) | (stored["torch", "cpu"] != stored["triton", device]))
    for i in bad.nonzero().flatten()[:6].tolist():
        torch_here, triton_here = stored["torch", device][i].item(), stored["triton", device][i].item()
        print(f"  store mismatch: x={flat[i].item()!r} x/scale={flat[i].double().item() / scale!r} "
              f"torch[{device}]={torch_here:#04x} triton={triton_here:#04x} "
              f"torch[cpu]={stored['torch', 'cpu'][i].item():#04x}")


def sweep(attention, ta, shapes, bench, bandwidth, device, torch):
    """Decode tile, stage, register-cap and split-count variants around the defaults, printed as they come. A
    program's registers bound how many share a multiprocessor, and the programs per multiprocessor
    (``programs_per_multiprocessor``) size the split count: the two are swept together."""
    if device == "cpu":
        return
    print("\n# decode sweeps, page 16 (us per layer; floor at measured copy bandwidth)")
    tilings = {torch.bfloat16: (dict(block_n=32, num_stages=3), dict(block_n=128, num_warps=8, num_stages=3),
                                dict(programs_per_multiprocessor=2), dict(programs_per_multiprocessor=4)),
               attention.FP8_DTYPE: (dict(programs_per_multiprocessor=2),
                                     dict(maxnreg=168, programs_per_multiprocessor=2),
                                     dict(maxnreg=168, programs_per_multiprocessor=3),
                                     dict(maxnreg=128, programs_per_multiprocessor=4),
                                     dict(block_n=64, num_stages=3, programs_per_multiprocessor=2),
                                     dict(block_n=64, num_stages=4, programs_per_multiprocessor=3),
                                     dict(block_n=64, num_stages=4, maxnreg=128, programs_per_multiprocessor=4))}
    for cache_dtype in (attention.FP8_DTYPE, torch.bfloat16):
        for page_size in (16, 64):
            for name, contexts, q_lens, causal in shapes.prefill_batches[:2]:
                case = Case(attention, shapes, contexts, q_lens, page_size, cache_dtype, 1, device, causal=causal)
                for kw in (dict(), dict(maxnreg=168), dict(maxnreg=128)):
                    t = bench.graph_ms(case.all_layers(ta.varlen_attention, **kw)) * 1e3
                    print(f"{name} p{page_size} {dtype_name(attention, cache_dtype)} varlen {kw}: {t:8.2f} us",
                          flush=True)
    # Split counts, and the merge kernel in place of the last program's merge (``merge_in_kernel=False``).
    for contexts, splits in (([1024] * 32, (1, 2)), ([4096] * 32, (1, 2, 4)), ([1024] * 128, ()),
                             ([4096] * 8, (2, 4, 8)), ([1024], (4, 16)), ([4096], (8, 16, 32, 64)),
                             ([8192], (16, 32)), ([16384], (16, 32))):
        for cache_dtype in (attention.FP8_DTYPE, torch.bfloat16):
            case = decode_case(attention, shapes, contexts, 16, cache_dtype, device)
            floor = (case.kv_bytes() + case.query.numel() * case.query.element_size()) / bandwidth * 1e6
            variants = ([dict()] + list(tilings[cache_dtype]) + [dict(num_splits=n) for n in splits]
                        + [dict(merge_in_kernel=False)])
            for kw in variants:
                try:
                    t = bench.graph_ms(case.all_layers(ta.decode_attention, **kw)) / case.layers * 1e3
                    label = f"decode b{len(contexts)} ctx{contexts[0] // 1024}k {dtype_name(attention, cache_dtype)}"
                    print(f"{label} {kw}: {t:8.2f} us  floor {floor:7.2f}  ({floor / t:5.1%})", flush=True)
                except Exception as exc:
                    print(f"decode b{len(contexts)} {kw}: failed {exc!r}"[:300])
    # Verification (causal) and drafter blocks of 16 tokens at batch 1: the split-KV kernel's block tiling
    # (``DECODE_BLOCK_TILING``) against the other tile sizes, layers rotated through more than the L2.
    for cache_dtype in (attention.FP8_DTYPE, torch.bfloat16):
        for ctx, causal in ((1024, True), (4096, True), (1024, False), (4096, False)):
            element_size = torch.empty((), dtype=cache_dtype).element_size()
            per_layer = ctx * 2 * shapes.num_kv_heads * shapes.head_dim * element_size
            layers = max(2, min(64, math.ceil(shapes.rotate_bytes / per_layer)))
            case = Case(attention, shapes, [ctx - 16], [16], 16, cache_dtype, layers, device, causal=causal)
            label = f"{'verify' if causal else 'draft'} 16 b1 ctx{ctx // 1024}k {dtype_name(attention, cache_dtype)}"
            for kw in (dict(), dict(block_n=32), dict(block_n=64), dict(block_n=128)):
                t = bench.graph_ms(case.all_layers(ta.decode_attention, **kw)) / layers * 1e3
                print(f"{label} {kw}: {t:8.2f} us", flush=True)


def fmt(value, spec):
    return format(value, spec) if isinstance(value, (int, float)) and not math.isnan(value) else "-"


def print_tables(decode_rows, prefill_rows, store_rows, bandwidth, env):
    print(f"\n# {env}; copy bandwidth {bandwidth / 1e12:.2f} TB/s (read+write)")
    print(f"\n{'decode (per layer)':30} {'ok':>3} {'rel err':>8} {'triton us':>10} {'MB read':>8} {'floor us':>9} "
          f"{'% floor':>8} {'GB/s':>6} {'varlen us':>10} {'torch us':>9} {'base us':>8} {'speedup':>8} {'bits':>5}")
    for r in decode_rows:
        pct = r["floor_us"] / r["us"] if "us" in r else float("nan")
        speedup = r["base_us"] / r["us"] if "base_us" in r else float("nan")
        same = {True: "same", False: "DIFF"}.get(r.get("same_as_base"), "-")
        print(f"{r['case']:30} {'yes' if r['ok'] else 'NO':>3} {fmt(r['err'], '.1e'):>8} "
              f"{fmt(r.get('us', math.nan), '.2f'):>10} {fmt(r.get('mb', math.nan), '.2f'):>8} "
              f"{fmt(r.get('floor_us', math.nan), '.2f'):>9} {fmt(pct, '.1%'):>8} "
              f"{fmt(r.get('gbs', math.nan), '.0f'):>6} {fmt(r.get('varlen_us', math.nan), '.2f'):>10} "
              f"{fmt(r.get('torch_us', math.nan), '.0f'):>9} {fmt(r.get('base_us', math.nan), '.2f'):>8} "
              f"{fmt(speedup, '.2f'):>8} {same:>5}")
    print(f"\n{'prefill / mixed / draft / verify':40} {'ok':>3} {'rel err':>8} {'kernel':>7} {'triton us':>10} "
          f"{'TFLOP/s':>8} {'base us':>8} {'speedup':>8} {'varlen us':>10} {'base varlen us':>15} {'torch us':>9}")
    for r in prefill_rows:
        speedup = r["base_us"] / r["us"] if "base_us" in r else float("nan")
        print(f"{r['case']:40} {'yes' if r['ok'] else 'NO':>3} {fmt(r['err'], '.1e'):>8} {r.get('kernel', '-'):>7} "
              f"{fmt(r.get('us', math.nan), '.1f'):>10} {fmt(r.get('tflops', math.nan), '.1f'):>8} "
              f"{fmt(r.get('base_us', math.nan), '.1f'):>8} {fmt(speedup, '.2f'):>8} "
              f"{fmt(r.get('varlen_us', math.nan), '.1f'):>10} {fmt(r.get('base_varlen_us', math.nan), '.1f'):>15} "
              f"{fmt(r.get('torch_us', math.nan), '.0f'):>9}")
    print(f"\n{'store (bitwise vs torch)':40} {'ok':>3} {'bytes != torch':>15} {'!= torch on cpu':>16}")
    for r in store_rows:
        print(f"{r['case']:40} {'yes' if r['ok'] else 'NO':>3} {fmt(r['err'], '.0f'):>15} "
              f"{fmt(r.get('vs_cpu', math.nan), '.0f'):>16}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes under TRITON_INTERPRET=1 on CPU")
    parser.add_argument("--no-sweep", action="store_true", help="the checks and their table only")
    parser.add_argument("--sweep-only", action="store_true", help="the tuning sweeps only")
    parser.add_argument("--baseline", metavar="TREE", help="time TREE/engine/triton_attention.py's kernels beside "
                        "this tree's, case by case in this run (e.g. git archive HEAD | tar -x -C .old)")
    args = parser.parse_args()
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    import triton

    attention, ta = import_attention()
    device = "cpu" if args.cpu_smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --cpu-smoke for the interpreted check")
    shapes = SMOKE_SHAPES if args.cpu_smoke else GPU_SHAPES
    torch.manual_seed(0)
    bench = Bench(device, shapes.reps)
    env = (f"{torch.cuda.get_device_name() if device == 'cuda' else 'cpu (interpreter)'}, torch {torch.__version__}, "
           f"triton {triton.__version__}, Hq={shapes.num_q_heads} Hkv={shapes.num_kv_heads} D={shapes.head_dim}")
    print(f"# {env}", flush=True)
    bandwidth = copy_bandwidth(bench, torch, device)
    # bf16 probabilities in the P @ V tensor-core product cost ~3e-3 relative; a wrong mask or page is >> 1e-2.
    tol = 1e-2
    decode_rows, prefill_rows, store_rows = [], [], []
    started = time.time()
    if args.sweep_only:
        sweep(attention, ta, shapes, bench, bandwidth, device, torch)
        return
    check_store(attention, shapes, device, torch, store_rows)
    base = import_baseline(args.baseline) if args.baseline else None
    check_decode(attention, ta, shapes, bench, bandwidth, device, torch, decode_rows, tol, base)
    print(f"# decode checks done at {time.time() - started:.0f}s", flush=True)
    check_prefill(attention, ta, shapes, bench, device, torch, prefill_rows, tol, base)
    print(f"# prefill checks done at {time.time() - started:.0f}s", flush=True)
    print_tables(decode_rows, prefill_rows, store_rows, bandwidth, env)
    failed = [r["case"] for r in decode_rows + prefill_rows + store_rows if not r["ok"]]
    print(f"\n# {len(failed)} failed{': ' + ', '.join(failed) if failed else ''}; {time.time() - started:.0f}s",
          flush=True)
    if not args.no_sweep and time.time() - started < SWEEP_DEADLINE_S:
        sweep(attention, ta, shapes, bench, bandwidth, device, torch)
        print(f"# total {time.time() - started:.0f}s")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
