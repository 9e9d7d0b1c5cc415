"""The metrics hub's view of which replicas are alive: /health and the autoscaling gauges rest on it."""

import os
import signal
import time

import pytest

from serve_app.metrics import STALE_GRACE_S, STALE_REPORTS, MetricsHub


def test_a_late_report_keeps_a_replica_and_a_silent_one_is_dropped():
    now = [1000.0]
    hub = MetricsHub(clock=lambda: now[0])
    interval = 0.2
    for name in ("prefill-a", "decode-b"):
        hub.report(name, {"role": name.split("-")[0], "healthy": True, "interval_s": interval})
    # A report thread on a loaded host runs late by more than STALE_REPORTS periods: the replica is still there.
    now[0] += STALE_REPORTS * interval + STALE_GRACE_S / 2
    assert set(hub.snapshots()) == {"prefill-a", "decode-b"}
    hub.report("prefill-a", {"role": "prefill", "healthy": True, "interval_s": interval})
    # decode-b stays silent past the grace: gone (dead or scaled down), and forgotten for good.
    now[0] += STALE_GRACE_S / 2 + 0.01
    assert set(hub.snapshots()) == {"prefill-a"}
    hub.forget("prefill-a")
    assert hub.snapshots() == {}


def test_every_ingress_serves_the_same_growing_totals():
    """With several ingress replicas a scrape may reach any of them: each reports its own counts to the hub first
    and serves the hub's view of all, so the totals never go back between scrapes (Prometheus would read a
    counter that went back as a reset), and an older report arriving late changes nothing."""
    from tests.test_serve_support import metric_samples, metric_sum

    from serve_app.metrics import ServiceMetrics

    hub = MetricsHub()
    ingresses = {name: ServiceMetrics("demo") for name in ("a", "b")}

    def finish(name, n):
        for _ in range(n):
            ingresses[name].observe_finished(num_prompt_tokens=3, num_generated=2, finish_reason="length", ttft=0.1,
                                             e2e=0.2, spec=None)

    def scrape(name):
        hub.report(name, ingresses[name].report(0.2))
        return metric_sum(metric_samples(ingresses[name].render(hub.snapshots()).decode()),
                          "dflash_request_success_total")

    finish("a", 3)
    finish("b", 2)
    stale = ingresses["a"].report(0.2)          # a's background report, overtaken below
    hub.report("b", ingresses["b"].report(0.2))
    finish("a", 5)
    totals = [scrape("a"), scrape("b")]
    hub.report("a", stale)                      # arrives after the newer one: ignored
    totals.append(scrape("b"))
    finish("b", 1)
    totals += [scrape("b"), scrape("a")]
    assert totals == [10, 10, 10, 11, 11]


def test_a_role_without_a_healthy_replica_reads_zero():
    """While Serve replaces a role's only replica its gauges read 0, not nothing: an alert on
    ``dflash_num_replicas{role="decode"} < 1`` must be able to fire."""
    from tests.test_serve_support import metric_samples, metric_sum

    from serve_app.metrics import ServiceMetrics

    metrics = ServiceMetrics("demo", ("prefill", "decode"))
    prefill = {"role": "prefill", "healthy": True, "running": 2, "waiting": 1,
               "pools": [{"pool": 0, "owner": "target+draft", "in_use": 5, "total": 64}]}
    for snapshots in ({"p": prefill}, {"p": prefill, "d": {**prefill, "role": "decode", "healthy": False}}):
        samples = metric_samples(metrics.render(snapshots).decode())
        assert metric_sum(samples, "dflash_num_replicas", role="prefill") == 1
        assert metric_sum(samples, "dflash_num_requests_running", role="prefill") == 2
        decode = [value for (name, labels), value in samples.items()
                  if name == "dflash_num_replicas" and ("role", "decode") in labels]
        assert decode == [0], decode


def test_the_engine_loops_time_is_summed_per_role_and_kind():
    """The engine loops' counters (``LoopStats`` snapshots in the replicas' reports) are summed per role, steps and
    their times per kind too; a replica that lost a rank is left out."""
    from tests.test_serve_support import metric_samples, metric_sum

    from serve_app.metrics import ServiceMetrics

    def loop(scale: float) -> dict:
        return {"steps": {"prompt": 2 * scale, "decode": 10 * scale}, "step_s": {"prompt": 0.5, "decode": scale},
                "step_cpu_s": {"prompt": 0.25, "decode": scale / 2}, "idle_s": 3.0, "uptime_s": 9.0,
                "thread_cpu_s": 4.0, "process_cpu_s": 5.0, "preemptions": 3 * scale,
                "device_wait_s": 0.125 * scale}

    base = {"healthy": True, "running": 0, "waiting": 0, "pools": []}
    snapshots = {"d1": {**base, "role": "decode", "loop": loop(1)}, "d2": {**base, "role": "decode", "loop": loop(2)},
                 "p": {**base, "role": "prefill", "loop": loop(4)},
                 "dead": {**base, "role": "decode", "healthy": False, "loop": loop(100)}}
    samples = metric_samples(ServiceMetrics("demo", ("prefill", "decode")).render(snapshots).decode())
    assert metric_sum(samples, "dflash_engine_steps_total", role="decode", kind="decode") == 30
    assert metric_sum(samples, "dflash_engine_steps_total", role="decode", kind="prompt") == 6
    assert metric_sum(samples, "dflash_engine_steps_total", role="prefill", kind="prompt") == 8
    assert metric_sum(samples, "dflash_engine_step_seconds_total", role="decode", kind="decode") == 3
    assert metric_sum(samples, "dflash_engine_step_cpu_seconds_total", role="prefill", kind="prompt") == 0.25
    assert metric_sum(samples, "dflash_engine_idle_seconds_total", role="decode") == 6
    assert metric_sum(samples, "dflash_engine_device_wait_seconds_total", role="decode") == 0.375
    assert metric_sum(samples, "dflash_engine_loop_seconds_total", role="prefill") == 9
    assert metric_sum(samples, "dflash_engine_process_cpu_seconds_total") == 15
    assert metric_sum(samples, "dflash_num_preemptions_total", role="decode") == 9


@pytest.mark.ray
def test_a_killed_replica_is_gone_from_the_hub_at_once_through_its_lifeline(ray_cluster):
    """SIGKILL leaves a replica no word to say: the hub would list it until its reports went stale (here, at 100 s
    a report, for five minutes). Its lifeline, an actor it owns (in the service, its rank-0 engine process), ends
    with it, and the hub's pending call to it tells at once: the replica is dropped, a report it sent before dying
    that arrives late is ignored. The same when the lifeline's own process dies (the engine process of a replica
    that is about to leave). Without ``watch`` neither is dropped before the staleness window."""
    import ray

    from actors.worker import Lifeline

    @ray.remote(num_cpus=0)
    class Owner:        # as a Serve replica owns its rank-0 engine process
        def __init__(self):
            self.engine = ray.remote(Lifeline).options(num_cpus=0, max_restarts=0).remote()

        def lifeline(self):
            return [self.engine]

        def pid(self) -> int:
            return os.getpid()

    hub = ray.remote(num_cpus=0)(MetricsHub).remote()
    owners = {name: Owner.remote() for name in ("prefill-killed", "decode-lost-engine", "decode-alive")}
    lifelines = {name: ray.get(o.lifeline.remote())[0] for name, o in owners.items()}
    snapshot = {"healthy": True, "interval_s": 100.0}
    for name in owners:
        ray.get(hub.report.remote(name, {**snapshot, "role": name.split("-")[0]}))
        ray.get(hub.watch.remote(name, lifelines[name]))
        ray.get(hub.watch.remote(name, lifelines[name]))       # renewed: still one watch
    assert set(ray.get(hub.snapshots.remote())) == set(owners)

    os.kill(ray.get(owners["prefill-killed"].pid.remote()), signal.SIGKILL)
    ray.kill(lifelines["decode-lost-engine"])
    killed = time.monotonic()
    while set(ray.get(hub.snapshots.remote())) != {"decode-alive"}:
        assert time.monotonic() - killed < 10, ray.get(hub.snapshots.remote())
        time.sleep(0.05)
    print(f"dropped {time.monotonic() - killed:.2f} s after the kills")
    ray.get(hub.report.remote("prefill-killed", {**snapshot, "role": "prefill"}))     # sent before it died
    assert set(ray.get(hub.snapshots.remote())) == {"decode-alive"}
    ray.get(hub.forget.remote("decode-alive"))      # scaled down: its watch ends with it
    assert ray.get(hub.snapshots.remote()) == {}
    ray.kill(owners["decode-alive"])
