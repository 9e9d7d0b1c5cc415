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
