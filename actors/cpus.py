"""Cores of their own for the engine processes (``engine_cpus`` in the service config).

An engine's step is mostly Python on one thread between kernel launches, so it runs as fast as the core it is on.
On a host whose logical CPUs share physical cores (SMT siblings, or virtual CPUs a hypervisor runs on fewer cores:
``benchmarks/cpu_interference.py`` finds which), an engine thread beside a busy ingress or load client steps up to
twice as slowly, and one the scheduler moves between cores loses its caches. With ``engine_cpus`` set (passed to
every process of the service as ``DFLASH_ENGINE_CPUS``), each engine process (rank 0's ``EngineHost`` and every
other rank's worker) binds all its threads to one of those cores that no other engine process on the node holds (a
lock file per core, released when the process ends, however it ends), and every other process of the service (the
ingresses, the replicas' own processes, the KV managers, the metrics hub) binds to the node's other cores.
Unset, nothing is bound.
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
from collections.abc import Iterable

log = logging.getLogger(__name__)

ENV = "DFLASH_ENGINE_CPUS"
_held: list[int] = []       # this process's claimed core's lock file descriptor (kept open for its life)


def format_cpus(cpus: Iterable[int] | None) -> str:
    return ",".join(str(c) for c in cpus or ())


def engine_cpus() -> list[int]:
    """The engine cores named in the environment (``0,1,2``; ranges ``0-2``), in order; [] if none."""
    spec = os.environ.get(ENV, "").strip()
    cpus: list[int] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        first, _, last = part.partition("-")
        try:
            span = range(int(first), int(last or first) + 1)
        except ValueError:
            raise ValueError(f"{ENV}={spec!r}: expected core ids like 0,1,2 or 0-2") from None
        cpus += [c for c in span if c not in cpus]
    return cpus


def bind_process(cpus: set[int]) -> None:
    """Bind every thread of this process to ``cpus`` (``sched_setaffinity`` binds one thread; threads started
    later inherit their starter's binding)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:      # a thread that just ended
            pass


def thread_cpus() -> list[list[int]]:
    """(Inspection) The distinct sets of cores this process's threads may run on (one set when bound)."""
    sets = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            sets.add(tuple(sorted(os.sched_getaffinity(int(tid)))))
        except ProcessLookupError:
            pass
    return [list(s) for s in sorted(sets)]


def _lock_path(cpu: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"dflash-engine-cpu-{cpu}.lock")


def claim_engine_cpu() -> int | None:
    """In an engine process: bind it to the first engine core no other engine process on this node holds, and hold
    that core until this process ends; None if no engine cores are set. With more engine processes than engine
    cores, the later ones share all of them (said in the log)."""
    if _held:
        return sorted(os.sched_getaffinity(0))[0]
    cpus = [c for c in engine_cpus() if c in os.sched_getaffinity(0)]
    if not cpus:
        if engine_cpus():
            log.warning("%s=%s names no core this process may run on: not binding it", ENV, format_cpus(engine_cpus()))
        return None
    for cpu in cpus:
        fd = os.open(_lock_path(cpu), os.O_CREAT | os.O_RDWR, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:     # another engine process holds it
            os.close(fd)
            continue
        _held.append(fd)
        bind_process({cpu})
        log.info("engine process bound to core %d", cpu)
        return cpu
    log.warning("more engine processes on this node than %s (%s): this one shares those cores", ENV,
                format_cpus(cpus))
    bind_process(set(cpus))
    return None


def leave_engine_cpus() -> set[int] | None:
    """In any other process of the service: bind it to the cores the engines do not have (the cores it may use
    now); None if no engine cores are set, or none would be left."""
    cpus = set(engine_cpus())
    rest = os.sched_getaffinity(0) - cpus
    if not cpus or not rest:
        return None
    bind_process(rest)
    return rest
