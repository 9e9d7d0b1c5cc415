"""Engine cores (``actors/cpus.py``, the service's ``engine_cpus``): each engine process of a node binds every thread
to a core no other engine process there holds, a core comes free when its holder dies however it dies, the rest of
the service keeps off those cores, and the setting reaches every process of an application. Real processes, real
affinities and lock files; run on any machine with at least 2 cores."""

from __future__ import annotations

import multiprocessing
import os
import signal

import pytest

from actors import cpus
from serve_app.config import ConfigError, parse_service_config

CORES = sorted(os.sched_getaffinity(0))
needs_two = pytest.mark.skipif(len(CORES) < 2, reason="needs 2 cores")     # CI's machines have 2


def _claimant(conn, env: dict[str, str], leave: bool) -> None:
    """A process that starts a thread, then claims an engine core (or leaves the engine cores), reports what its
    threads may run on, and stays until told to go (holding its claim)."""
    import threading

    os.environ.update(env)
    ready = threading.Event()
    threading.Thread(target=lambda: (ready.set(), threading.Event().wait()), daemon=True).start()
    ready.wait()
    got = cpus.leave_engine_cpus() if leave else cpus.claim_engine_cpu()
    conn.send((got, cpus.thread_cpus()))
    conn.recv()


class Claimants:
    def __init__(self, tmp_path):
        self.env = {"TMPDIR": str(tmp_path)}       # this test's lock files, apart from any service on the machine
        self.ctx = multiprocessing.get_context("spawn")
        self.procs = []

    def start(self, spec: str, leave: bool = False):
        parent, child = self.ctx.Pipe()
        p = self.ctx.Process(target=_claimant, args=(child, {**self.env, cpus.ENV: spec}, leave), daemon=True)
        p.start()
        assert parent.poll(60), "the claimant did not report"
        self.procs.append((p, parent))
        return p, parent.recv()

    def stop(self):
        for p, conn in self.procs:
            if p.is_alive():
                conn.send("go")
                p.join(10)


@pytest.fixture
def claimants(tmp_path):
    c = Claimants(tmp_path)
    yield c
    c.stop()


def test_the_engine_cores_parse_from_lists_and_ranges(monkeypatch):
    monkeypatch.setenv(cpus.ENV, "3, 0-2,2,7-7")
    assert cpus.engine_cpus() == [3, 0, 1, 2, 7]
    monkeypatch.setenv(cpus.ENV, "")
    assert cpus.engine_cpus() == []
    monkeypatch.setenv(cpus.ENV, "1,two")
    with pytest.raises(ValueError, match=cpus.ENV):
        cpus.engine_cpus()


@needs_two
def test_each_engine_process_gets_a_core_of_its_own_for_every_thread_until_it_dies(claimants):
    a, b = CORES[-2:]
    spec = f"{a},{b}"
    first, (core, threads) = claimants.start(spec)
    assert (core, threads) == (a, [[a]])      # both threads, the one started before the claim too
    _, (core, threads) = claimants.start(spec)
    assert (core, threads) == (b, [[b]])
    _, (core, threads) = claimants.start(spec)      # a third engine: none is free, it shares the engine cores
    assert (core, threads) == (None, [[a, b]])
    os.kill(first.pid, signal.SIGKILL)      # killed: its claim goes with it
    first.join(10)
    _, (core, threads) = claimants.start(spec)
    assert (core, threads) == (a, [[a]])


@needs_two
def test_the_rest_of_the_service_keeps_off_the_engine_cores(claimants):
    engine = CORES[-1]
    _, (rest, threads) = claimants.start(str(engine), leave=True)
    assert rest == set(CORES) - {engine} and threads == [sorted(rest)]
    _, (rest, threads) = claimants.start(",".join(map(str, CORES)), leave=True)     # nothing would be left
    assert rest is None and threads == [CORES]
    _, (rest, threads) = claimants.start("", leave=True)         # unset: nothing is bound
    assert rest is None and threads == [CORES]


def test_engine_cpus_reach_every_process_of_the_application():
    from serve_app.app import _engine_options

    service = parse_service_config({"engine_cpus": [2, 3]})
    assert service.process_env() == {cpus.ENV: "2,3"}
    for role in ("prefill", "decode"):
        env = _engine_options(getattr(service, role), service)["ray_actor_options"]["runtime_env"]["env_vars"]
        assert env[cpus.ENV] == "2,3"
    assert parse_service_config({}).process_env() == {}
    for bad in ([1, 1], [-1], []):
        with pytest.raises(ConfigError, match="engine_cpus"):
            parse_service_config({"engine_cpus": bad})


@pytest.mark.ray
@needs_two
def test_a_replicas_engine_process_binds_to_its_core_and_the_replica_keeps_off_it(ray_cluster, tiny_target):
    """Through Ray, as the service starts them: the environment a replica actor gets reaches the engine process it
    starts (Ray passes an actor's runtime environment to the actors it creates), which binds to the engine core;
    the replica's own process binds to the others. The replica serves as before."""
    import ray

    from actors.replica import AggregatedReplica
    from engine.llm import EngineConfig
    from engine.sequence import SamplingParams

    engine = CORES[-1]
    replica = ray.remote(AggregatedReplica).options(
        num_cpus=0, runtime_env={"env_vars": {cpus.ENV: str(engine)}}).remote(
        EngineConfig(model=str(tiny_target), page_size=16, num_pages=32))
    try:
        got = ray.get(replica.thread_cpus.remote(), timeout=120)
        assert got == {"replica": [sorted(set(CORES) - {engine})], "engine": [[engine]]}
        outputs = ray.get(replica.generate_all.remote([("r", [5, 6, 7], SamplingParams(max_tokens=4))]), timeout=120)
        assert len(outputs[0].token_ids) == 4
    finally:
        ray.get(replica.shutdown.remote(), timeout=60)
        ray.kill(replica)
