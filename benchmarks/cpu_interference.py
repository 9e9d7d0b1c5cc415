"""Which logical CPUs of this host slow each other: the speed of a Python loop on core ``i`` while one other core
``j`` spins, against ``i`` alone, for every pair, and then with more and more other cores busy. For choosing the
service's ``engine_cpus`` (``actors/cpus.py``): an engine's step is Python on one thread, as fast as its core, and
a host's logical CPUs may share physical cores without saying so (SMT siblings; a virtual machine's CPUs that its
hypervisor runs on fewer cores report one thread a core).

    python3 benchmarks/cpu_interference.py                  # every core (about 30 s on 16)
    python3 benchmarks/cpu_interference.py --cpus 0 9       # only these as ``i``

Prints the matrix (rows ``i``, columns ``j``; 1.00 = unaffected; under ``--slow`` marked), the cores no single busy
core slowed, and each probed core's speed with 3, 6, ... others busy.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time


def _spinner(cpu: int, go, stop) -> None:
    os.sched_setaffinity(0, {cpu})
    while not stop.is_set():
        if go.wait(0.05):
            for _ in range(20_000):
                pass


def _loop_s(n: int) -> float:
    began = time.perf_counter()
    x = 0
    for i in range(n):
        x += i
    return time.perf_counter() - began


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpus", type=int, nargs="+", default=None, help="the cores to probe (default: every one)")
    p.add_argument("--iterations", type=int, default=1_500_000, help="of the timed loop (about 50 ms)")
    p.add_argument("--repeats", type=int, default=2, help="timed loops per measurement; the fastest counts")
    p.add_argument("--slow", type=float, default=0.8, help="mark speeds under this")
    args = p.parse_args()

    cpus = sorted(os.sched_getaffinity(0))
    probed = [c for c in (args.cpus or cpus) if c in cpus]
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    gos = {c: ctx.Event() for c in cpus}
    spinners = [ctx.Process(target=_spinner, args=(c, gos[c], stop), daemon=True) for c in cpus]
    for s in spinners:
        s.start()
    time.sleep(1.0)

    def speed(cpu: int, busy: list[int], alone: float) -> float:
        for c in busy:
            gos[c].set()
        time.sleep(0.02)
        os.sched_setaffinity(0, {cpu})
        t = min(_loop_s(args.iterations) for _ in range(args.repeats))
        for c in busy:
            gos[c].clear()
        return alone / t

    rows: dict[int, dict[int, float]] = {}
    alone_s: dict[int, float] = {}
    crowds: dict[int, list[tuple[int, float]]] = {}
    try:
        for i in probed:
            os.sched_setaffinity(0, {i})
            alone_s[i] = min(_loop_s(args.iterations) for _ in range(args.repeats + 1))
            rows[i] = {j: speed(i, [j], alone_s[i]) for j in cpus if j != i}
            others = [j for j in cpus if j != i]
            crowds[i] = [(k, speed(i, others[:k], alone_s[i])) for k in sorted({min(k, len(others))
                                                                                for k in (3, 6, 10, len(others))})]
    finally:
        stop.set()
        for s in spinners:
            s.join(5)
    width = max(len(str(c)) for c in cpus) + 6
    print(f"speed of core i (rows) while core j (columns) spins; * under {args.slow:g}\n")
    print("i \\ j".ljust(8) + "".join(str(j).rjust(width) for j in cpus) + "   alone ms")
    for i in probed:
        cells = "".join(("-" if j == i else f"{rows[i][j]:.2f}{'*' if rows[i][j] < args.slow else ' '}").rjust(width)
                        for j in cpus)
        print(str(i).ljust(8) + cells + f"   {alone_s[i] * 1e3:.1f}")
    calm = [i for i in probed if min(rows[i].values()) >= args.slow]
    print(f"\nno single busy core slowed these under {args.slow:g}: {calm or 'none'}")
    for i in probed:
        print(f"core {i} with others busy: " + ", ".join(f"{k}: {s:.2f}" for k, s in crowds[i]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
