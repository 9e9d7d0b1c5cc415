"""The engine deployments of the Serve application: the replicas of ``actors.replica``, built from the
service config, each reporting its engine gauges to the metrics hub."""

from __future__ import annotations

import logging
import os
import threading
import time

from actors.replica import AggregatedReplica, DecodeReplica, PrefillReplica
from serve_app.config import ServiceConfig
from serve_app.metrics import HubClient, engine_snapshot

log = logging.getLogger(__name__)

# How long a replica that lost a process stays up after failing its requests: their error chunks reach the callers.
LEAVE_AFTER_S = 1.0
# How often a replica gives the metrics hub its lifeline again (``MetricsHub.watch``: a no-op while the hub holds
# it; a hub that was replaced learns of it within this).
LIFELINE_RENEW_S = 10.0


class _Served:
    """Mixed into a replica class: the Serve constructor (a ServiceConfig dict and the application's
    MetricsHub handle) and the metrics reporter."""

    def __init__(self, service: dict, hub):
        self.service = ServiceConfig.model_validate(service)
        super().__init__(self.service.model.engine_config(), tp_size=self.service.tp_size(self.role),
                         num_threads=self.service.model.num_threads,
                         hold_timeout_s=self.service.hold_timeout_s, transfer_draft_kv=self.service.transfer_draft_kv,
                         kv_transport=self.service.kv_transport, stream_interval=self.service.stream_interval,
                         ticket_timeout_s=self.service.ticket_timeout_s,
                         reserve_timeout_s=self.service.reserve_timeout_s)
        self._closed = threading.Event()
        self._hub = HubClient(hub)
        self._reporter = threading.Thread(target=self._report, name="metrics-reporter", daemon=True)
        self._reporter.start()

    def _report(self) -> None:
        lifeline_at = None
        while not self._closed.wait(self.service.metrics_report_interval_s):
            try:
                if lifeline_at is None or time.monotonic() - lifeline_at >= LIFELINE_RENEW_S:
                    # Rank 0's engine process, which this process owns: it ends when this process dies, and the
                    # hub's pending call to it fails then (a SIGKILL says nothing else).
                    self._hub.watch(self.replica_id, self.group.host)
                    lifeline_at = time.monotonic()
                interval = self.service.metrics_report_interval_s
                problems = self.group.health_problems(timeout_s=min(2.0, 4 * interval))
                if any(p.fatal for p in problems):
                    # A replica whose rank died fails its requests, reports itself unhealthy at once (/health
                    # turns 503 while its role has no other replica) and leaves.
                    self.lost_rank(problems)
                    self._hub.report(self.replica_id, {"role": self.role, "healthy": False, "interval_s": interval,
                                                       "running": 0, "waiting": 0, "pools": []})
                    self._leave()
                    return
                # A rank slow to answer (a loaded host) is no reason to turn /health red: it serves on.
                if problems:
                    log.warning("%s: a rank is slow to answer: %s", self.replica_id, "; ".join(map(str, problems)))
                gauges = self.group.host.gauges.remote().future().result(timeout=10)
                self._hub.report(self.replica_id, engine_snapshot(gauges, self.role, interval))
            except Exception as e:      # a missed report only ages the gauges; keep the replica serving
                if self._closed.is_set():      # shut down while reporting: the engine loop is gone, as meant
                    return
                if isinstance(e, TimeoutError):     # a stalled or loaded engine process: the health check says more
                    log.warning("%s: metrics report timed out (the engine's process did not answer)", self.replica_id)
                else:
                    log.exception("metrics report failed")

    def _leave(self) -> None:
        """End this replica's process: it lost a process of its own and serves nothing more (``lost_rank`` failed
        its requests). A replica that stayed up until Serve's health check took it out kept being chosen by the
        ingresses' routers and refused every request sent to it meanwhile (for seconds; `benchmarks/soak.py
        --kill-every`); a dead one is passed over as soon as a router sends to it (Serve routes that request to
        another replica), and Serve replaces it. The rank actors it owns end with it."""
        log.error("%s lost a process: it leaves in %.1f s, and Serve replaces it", self.replica_id, LEAVE_AFTER_S)
        if self._closed.wait(LEAVE_AFTER_S):     # shut down meanwhile: Serve stops it anyway
            return
        self._hub.forget(self.replica_id)
        time.sleep(0.2)                 # (the call goes out on the replica's event loop)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(1)

    def __del__(self):
        self.shutdown()

    def shutdown(self) -> None:
        if getattr(self, "_closed", None) is None or self._closed.is_set():
            return
        self._closed.set()
        try:
            self._hub.forget(self.replica_id)
        except Exception:
            pass
        super().shutdown()


class AggregatedServer(_Served, AggregatedReplica):
    pass


class PrefillServer(_Served, PrefillReplica):
    pass


class DecodeServer(_Served, DecodeReplica):
    pass
