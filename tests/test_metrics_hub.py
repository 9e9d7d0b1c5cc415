"""The metrics hub's view of which replicas are alive: /health and the autoscaling gauges rest on it."""

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
