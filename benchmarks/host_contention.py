"""What slows the engine's steps in a serving process: the machine's other busy cores, or a second thread of the
engine's own process (its event loop) taking the interpreter lock between the engine's calls. One run, side by side.

    PYTHONPATH=. python3 benchmarks/host_contention.py --device cuda          # demo pair, float32, on a GPU
    PYTHONPATH=. .venv/bin/python benchmarks/host_contention.py --busy 1      # this machine (a check of the script)

The offline engine (the demo pair, as ``benchmarks/gpu_service.py`` builds it) runs the staggered closed loop
(``gpu_service.closed_loop``: ``--concurrency`` held-out prompts in flight, a new one as each ends, started one step
apart as HTTP arrivals are) under each condition in turn, the whole sequence ``--repeats`` times:

- ``alone``: nothing else runs;
- ``busy cores``: ``--busy`` other processes each spin a core in Python (the ingresses, replicas, load client and
  other engines of a loaded service take 4-6 cores of a 16-core GPU host);
- ``thread``: a second thread in the engine's process runs Python in short bursts (``--burst-us`` of work, then
  ``--gap-us`` asleep: about what the engine process's event loop spends sending frames and taking commands under
  load, 0.1-0.16 of a core), so every call that lets go of the interpreter lock may hand it over.

Reported per condition: output tokens/s, the p50 wall time of steps that computed a prompt and of the others, and
the engine thread's CPU time per step; the ratios are against ``alone`` in the same repeat.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _spin(stop) -> None:
    while not stop.is_set():
        for _ in range(10_000):
            pass


class BusyCores:
    """``n`` processes spinning a core each while inside the block."""

    def __init__(self, n: int):
        self.n = n

    def __enter__(self):
        ctx = multiprocessing.get_context("spawn")
        self.stop = ctx.Event()
        self.procs = [ctx.Process(target=_spin, args=(self.stop,), daemon=True) for _ in range(self.n)]
        for p in self.procs:
            p.start()
        time.sleep(0.5)       # spawned and spinning
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for p in self.procs:
            p.join(10)
        return False


class BurstyThread:
    """A thread of this process that runs ``burst_us`` of Python bytecode, then sleeps ``gap_us``, until the
    block ends; ``cpu_share`` tells what it used."""

    def __init__(self, burst_us: float, gap_us: float):
        self.burst_s, self.gap_s = burst_us / 1e6, gap_us / 1e6
        self.stop = threading.Event()

    def _run(self) -> None:
        payload = {"tokens": list(range(64)), "text": "x" * 64}
        while not self.stop.is_set():
            end = time.perf_counter() + self.burst_s
            while time.perf_counter() < end:
                payload = dict(payload)          # small allocations, as building a frame does
            time.sleep(self.gap_s)
        self.cpu_s = time.thread_time()

    def __enter__(self):
        self.began = time.perf_counter()
        self.thread = threading.Thread(target=self._run, name="bursty", daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(10)
        self.cpu_share = self.cpu_s / (time.perf_counter() - self.began)
        return False


def timed_loop(llm, prompts, params, concurrency: int) -> dict:
    """``closed_loop`` (staggered) with the engine thread's CPU time per step beside it."""
    from benchmarks.gpu_service import closed_loop

    cpu = time.thread_time()
    row = closed_loop(llm, prompts, params, concurrency, stagger=True)
    steps = row["prefill_steps"] + row["decode_steps"]
    row["cpu_ms_per_step"] = (time.thread_time() - cpu) / steps * 1e3
    row["wall_ms_per_step"] = (row["prefill_step_s_total"] + row["decode_step_s_total"]) / steps * 1e3
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--busy", type=int, default=6, help="spinning processes in the 'busy cores' condition")
    p.add_argument("--burst-us", type=float, default=50.0)
    p.add_argument("--gap-us", type=float, default=300.0)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--conditions", nargs="+", choices=["alone", "busy", "thread"], default=["alone", "busy", "thread"],
                   help="which conditions to run (alone: the engine's own figures, e.g. to compare two trees)")
    args = p.parse_args()

    from benchmarks.gpu_service import demo_llm
    from benchmarks.serve_bench import _bench_args
    from engine.sequence import SamplingParams
    from serve_app.bench import _prompts

    llm = demo_llm(args.device, "float32")
    ns = argparse.Namespace(prompt_file=str(REPO / "benchmarks" / "prompts" / "heldout.jsonl"), input_len=64,
                            output_len=args.output_len, min_requests=args.requests)
    prompts = _prompts(_bench_args("", "offline", args.concurrency, ns))
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    timed_loop(llm, prompts[:2 * args.concurrency], params, args.concurrency)        # warm-up
    conditions = {"alone": lambda: _Nothing(), f"busy cores ({args.busy})": lambda: BusyCores(args.busy),
                  f"thread ({args.burst_us:g} us / {args.gap_us:g} us)": lambda: BurstyThread(args.burst_us,
                                                                                             args.gap_us)}
    conditions = {name: make for (key, (name, make)) in zip(("alone", "busy", "thread"), conditions.items())
                  if key in args.conditions}
    rows = []
    for repeat in range(args.repeats):
        base = None
        for name, make in conditions.items():
            with make() as cm:
                row = timed_loop(llm, prompts, params, args.concurrency)
            row.update(condition=name, repeat=repeat, thread_cpu_share=getattr(cm, "cpu_share", None))
            base = base or row
            row["vs_alone"] = row["output_throughput"] / base["output_throughput"]     # (the first run, if not)
            rows.append(row)
            print(_line(row), flush=True)
    print(f"\n{args.device}: staggered closed loop, {args.concurrency} streams, {len(prompts)} requests of "
          f"{args.output_len} tokens\n")
    print("| repeat | condition | tok/s | / alone | prompt step p50 ms | other step p50 ms | wall ms a step | "
          "CPU ms a step |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['repeat']} | {r['condition']} | {r['output_throughput']:.0f} | {r['vs_alone']:.2f} | "
              f"{r['prefill_step_ms_p50']:.2f} | {r['decode_step_ms_p50']:.2f} | {r['wall_ms_per_step']:.2f} | "
              f"{r['cpu_ms_per_step']:.2f} |")
    shares = [r["thread_cpu_share"] for r in rows if r["thread_cpu_share"] is not None]
    if shares:
        print(f"\nthe bursty thread used {statistics.median(shares):.2f} of a core")
    return 0


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _line(r: dict) -> str:
    return (f"{r['condition']}: {r['output_throughput']:.0f} tok/s ({r['vs_alone']:.2f}x alone), steps "
            f"{r['wall_ms_per_step']:.2f} ms wall / {r['cpu_ms_per_step']:.2f} ms CPU")


if __name__ == "__main__":
    sys.exit(main())
