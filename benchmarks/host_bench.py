"""The engine's host work per decode step against the context length, in one run.

    PYTHONPATH=. .venv/bin/python benchmarks/host_bench.py                 # CPU, ~1 min
    PYTHONPATH=. python3 benchmarks/host_bench.py --device cuda            # the same on a GPU

A random two-layer target with a one-layer random DFlash drafter (speed only). Per context length, a batch of
requests shares one long prompt (the first computes it; the others take it from the prefix cache, so the run does
not spend minutes in prefill) and then decodes with speculation, each step timed. The step's computing calls (the
target forward with its metadata, the drafter's proposals and context stores) are timed apart, each ending in a
device sync; what is left of the step is the engine's host work: scheduling, the ids a step reads, acceptance,
appending, the prefix cache's commit, outputs. The figure: that host time at each length over the shortest
length's, side by side in the run; 1.0 means the host's work per step does not grow with the context.
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch

# Small enough that a 16k-token prompt is computed in seconds on a CPU core, long enough a context for it.
PRESET = dict(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, head_dim=32, max_position_embeddings=40000)


class ComputeClock:
    """Wraps the engine's computing calls: each one's wall time (after a device sync) is added up."""

    def __init__(self, engine, device: torch.device):
        self.seconds = 0.0
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        owners = [(engine.runner, ("run", "run_ahead"))]
        if engine.speculator is not None:
            owners.append((engine.speculator, ("propose", "store_context", "draft_ahead")))
        for owner, names in owners:
            for name in names:
                if hasattr(owner, name):
                    setattr(owner, name, self._timed(getattr(owner, name), sync))

    def _timed(self, fn, sync):
        def timed(*args, **kwargs):
            sync()
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            sync()
            self.seconds += time.perf_counter() - start
            return out
        return timed


def measure(engine, clock: ComputeClock, length: int, batch: int, steps: int, seed: int) -> dict:
    from engine import SamplingParams

    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, PRESET["vocab_size"] - 1, (length,), generator=g).tolist()
    params = SamplingParams(max_tokens=steps * 4 + 8, ignore_eos=True)
    engine.add_request(prompt + [1], SamplingParams(max_tokens=1, ignore_eos=True))
    while engine.has_unfinished():          # the shared prompt, computed once into the prefix cache
        engine.step()
    requests = [engine.add_request(prompt + [2 + i], params) for i in range(batch)]
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in requests):
        engine.step()
    for _ in range(3):                      # warm-up decode steps
        engine.step()
    walls, computes = [], []
    for _ in range(steps):
        before = clock.seconds
        start = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - start)
        computes.append(clock.seconds - before)
    for r in requests:
        engine.abort(r.request_id)
    hosts = [w - c for w, c in zip(walls, computes)]
    return dict(length=length, cached=min(r.num_cached_tokens for r in requests),
                step_ms=statistics.median(walls) * 1e3, compute_ms=statistics.median(computes) * 1e3,
                host_ms=statistics.median(hosts) * 1e3)


def main() -> None:
    from benchmarks.spec_bench import random_engines

    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 4096, 16384])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=2, help="passes over the lengths (medians of the passes)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    _, engine, _ = random_engines(SimpleNamespace(device=args.device, dtype="float32", kv_cache_dtype="auto",
                                                  block_size=8, num_prompts=1), PRESET,
                                  kv_cache_bytes=128 * 2**20, max_num_batched_tokens=1024, n_draft=1)
    clock = ComputeClock(engine, device)
    runs: dict[int, list[dict]] = {n: [] for n in args.lengths}
    for rep in range(args.repeats):
        for n in args.lengths:
            runs[n].append(measure(engine, clock, n, args.batch, args.steps, seed=rep * 1000 + n))
    print(f"device {args.device}, batch {args.batch}, drafts {engine.speculator.num_spec_tokens} a step, "
          f"median of {args.steps} steps, median of {args.repeats} passes")
    print("| context | cached | step ms | compute ms | host ms | host / host at the shortest |")
    print("|---|---|---|---|---|---|")
    base = statistics.median(r["host_ms"] for r in runs[args.lengths[0]])
    for n in args.lengths:
        med = {k: statistics.median(r[k] for r in runs[n]) for k in ("step_ms", "compute_ms", "host_ms")}
        print(f"| {n} | {min(r['cached'] for r in runs[n])} | {med['step_ms']:.3f} | {med['compute_ms']:.3f} | "
              f"{med['host_ms']:.3f} | {med['host_ms'] / base:.2f} |")


if __name__ == "__main__":
    main()
