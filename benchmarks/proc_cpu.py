"""Where a benchmark's CPU goes: per process (and per thread of the busiest), from Linux's /proc, between two
snapshots. A serving path that is CPU-bound shows one process, or one thread of it, near a whole core.

    before = snapshot(); ...load...; after = snapshot()
    usage(before, after, wall_s)   # [{"process": title, "pid", "cores", "threads": [[name, cores], ...]}, ...]

Processes are named by their title (Ray sets ``ray::<actor class>`` or ``ray::ServeReplica:<app>:<deployment>``)
and this process is ``driver``.
"""

from __future__ import annotations

import os
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_ticks(stat: str) -> tuple[str, int]:
    """(comm, utime + stime) of a /proc stat line (the name is in parentheses and may hold spaces)."""
    name = stat[stat.index("(") + 1:stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2:].split()
    return name, int(fields[11]) + int(fields[12])


def _title(pid: int) -> str:
    if pid == os.getpid():
        return "driver"
    raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    words = [w for w in raw.decode(errors="replace").split("\0") if w]
    return " ".join(words)[:80] if words else "?"


def snapshot() -> dict[int, dict]:
    """Per process: its title, CPU ticks, and per thread (tid -> (comm, ticks)); processes that vanish
    while being read are left out."""
    processes = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            _, ticks = _cpu_ticks((entry / "stat").read_text())
            threads = {}
            for task in (entry / "task").iterdir():
                threads[int(task.name)] = _cpu_ticks((task / "stat").read_text())
            processes[pid] = {"title": _title(pid), "ticks": ticks, "threads": threads}
        except (OSError, ValueError, IndexError):
            continue
    return processes


def usage(before: dict[int, dict], after: dict[int, dict], wall_s: float, *, top: int = 8,
          min_cores: float = 0.02) -> list[dict]:
    """The processes that used the most CPU between the snapshots (cores = CPU seconds / wall seconds), busiest
    first, each with its three busiest threads."""
    rows = []
    for pid, now in after.items():
        then = before.get(pid, {"ticks": 0, "threads": {}})
        cores = (now["ticks"] - then["ticks"]) / TICK / wall_s
        if cores < min_cores:
            continue
        threads = sorted(((name, (ticks - then["threads"].get(tid, (name, 0))[1]) / TICK / wall_s)
                          for tid, (name, ticks) in now["threads"].items()), key=lambda t: -t[1])[:3]
        rows.append({"process": now["title"], "pid": pid, "cores": round(cores, 3),
                     "threads": [[name, round(c, 3)] for name, c in threads]})
    return sorted(rows, key=lambda r: -r["cores"])[:top]


def format_usage(rows: list[dict]) -> str:
    return "\n".join(f"  {r['cores']:5.2f} cores  {r['process'][:60]}  (threads: "
                     + ", ".join(f"{name} {c:.2f}" for name, c in r["threads"]) + ")" for r in rows)


def bench_with_cpu(bench, args) -> dict:
    """``bench(args)`` (``serve_app.bench.bench``) with the CPU each process used meanwhile as ``summary["cpu"]``."""
    import time

    before, start = snapshot(), time.perf_counter()
    summary = bench(args)
    summary["cpu"] = usage(before, snapshot(), time.perf_counter() - start)
    return summary
