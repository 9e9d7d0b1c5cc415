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
  load, 0.1-0.16 of a core), so every call that lets go of the interpreter lock may hand it over;
- ``pinned``: every thread of the engine's process bound to one core (``--pin-cpu``, default the last), nothing
  else running: what moving between cores costs the engine;
- ``busy, pinned``: pinned, with ``--busy`` spinning processes bound to the other cores: whether a core of its
  own gives the engine back what other busy cores take.

Reported per condition: output tokens/s, the p50 wall time of steps that computed a prompt and of the others, and
the engine thread's CPU time per step; the ratios are against ``alone`` in the same repeat.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
CONDITIONS = ("alone", "busy", "thread", "pinned", "busy-pinned")


def _spin(stop, cpus=None) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)
    while not stop.is_set():
        for _ in range(10_000):
            pass


class BusyCores:
    """``n`` processes spinning a core each while inside the block (on ``cpus`` only, if given)."""

    def __init__(self, n: int, cpus: set[int] | None = None):
        self.n, self.cpus = n, cpus

    def __enter__(self):
        ctx = multiprocessing.get_context("spawn")
        self.stop = ctx.Event()
        self.procs = [ctx.Process(target=_spin, args=(self.stop, self.cpus), daemon=True) for _ in range(self.n)]
        for p in self.procs:
            p.start()
        time.sleep(0.5)       # spawned and spinning
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for p in self.procs:
            p.join(10)
        return False


class Pinned:
    """This process's threads on ``cpu`` alone while inside the block (and ``busy`` spinners on the other cores)."""

    def __init__(self, cpu: int, busy: int = 0):
        self.cpu, self.busy = cpu, busy

    def __enter__(self):
        from actors.cpus import bind_process

        self.before = os.sched_getaffinity(0)
        bind_process({self.cpu})
        self.spinners = BusyCores(self.busy, self.before - {self.cpu}).__enter__() if self.busy else None
        return self

    def __exit__(self, *exc):
        from actors.cpus import bind_process

        if self.spinners is not None:
            self.spinners.__exit__(*exc)
        bind_process(self.before)
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
    p.add_argument("--pin-cpu", type=int, default=max(os.sched_getaffinity(0)),
                   help="the core of the pinned conditions (default: the last)")
    p.add_argument("--conditions", nargs="+", choices=list(CONDITIONS), default=["alone", "busy", "thread"],
                   help="which conditions to run (alone: the engine's own figures, e.g. to compare two trees)")
    args = p.parse_args()

    from benchmarks.gpu_service import demo_llm
    from benchmarks.serve_bench import _bench_args
    from engine.sequence import SamplingParams
    from serve_app.bench import _prompts

    import torch

    torch.set_num_threads(1)      # as the service's engine processes (an idle pool thread spins on its core)
    llm = demo_llm(args.device, "float32")
    ns = argparse.Namespace(prompt_file=str(REPO / "benchmarks" / "prompts" / "heldout.jsonl"), input_len=64,
                            output_len=args.output_len, min_requests=args.requests)
    prompts = _prompts(_bench_args("", "offline", args.concurrency, ns))
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    timed_loop(llm, prompts[:2 * args.concurrency], params, args.concurrency)        # warm-up
    conditions = {"alone": ("alone", lambda: _Nothing()),
                  "busy": (f"busy cores ({args.busy})", lambda: BusyCores(args.busy)),
                  "thread": (f"thread ({args.burst_us:g} us / {args.gap_us:g} us)",
                             lambda: BurstyThread(args.burst_us, args.gap_us)),
                  "pinned": (f"pinned (cpu {args.pin_cpu})", lambda: Pinned(args.pin_cpu)),
                  "busy-pinned": (f"busy cores ({args.busy}), pinned (cpu {args.pin_cpu})",
                                  lambda: Pinned(args.pin_cpu, args.busy))}
    conditions = dict(conditions[key] for key in CONDITIONS if key in args.conditions)
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
