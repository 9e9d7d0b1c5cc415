"""Prometheus metrics of the service, in vLLM's naming style with a ``dflash_`` prefix.

Request-level counters and histograms live in the ingress process (it sees every token go out). Engine
state that only the replicas know (requests running and waiting, KV pages in use) is pushed by each
replica to a small named ``MetricsHub`` actor; the ingress reads the hub on every scrape, so /metrics
aggregates every live replica without the ingress having to reach replicas one by one.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
HUB_FRESH_S = 3.0      # a replica that has not reported for this long is gone (scaled down or dead)


def hub_name(app_name: str) -> str:
    return f"dflash-metrics-{app_name}"


class MetricsHub:
    """Latest engine snapshot of every live replica (a Ray actor; replicas report, the ingress reads)."""

    def __init__(self):
        self._snapshots: dict[str, tuple[float, dict]] = {}

    def report(self, replica: str, snapshot: dict) -> None:
        self._snapshots[replica] = (time.monotonic(), snapshot)

    def forget(self, replica: str) -> None:
        self._snapshots.pop(replica, None)

    def snapshots(self) -> dict[str, dict]:
        now = time.monotonic()
        for replica in [r for r, (t, _) in self._snapshots.items() if now - t > HUB_FRESH_S]:
            del self._snapshots[replica]
        return {replica: snap for replica, (_, snap) in self._snapshots.items()}


def get_hub(app_name: str):
    """The application's hub, created on first use (detached: replicas come and go, the hub stays)."""
    import ray

    return ray.remote(MetricsHub).options(name=hub_name(app_name), namespace="dflash", get_if_exists=True,
                                          lifetime="detached", num_cpus=0).remote()


class ServiceMetrics:
    """The ingress's registry: request metrics observed here, replica gauges filled from the hub per scrape."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = r = CollectorRegistry()
        m = ["model_name"]
        self.running = Gauge("dflash_num_requests_running", "Requests in an engine's running batch", m + ["role"],
                             registry=r)
        self.waiting = Gauge("dflash_num_requests_waiting", "Requests waiting for a batch slot or their KV transfer",
                             m + ["role"], registry=r)
        self.replicas = Gauge("dflash_num_replicas", "Engine replicas reporting", m + ["role"], registry=r)
        self.pages_in_use = Gauge("dflash_kv_pages_in_use", "KV pages in use", m + ["role", "pool", "owner"],
                                  registry=r)
        self.pages_total = Gauge("dflash_kv_pages_total", "KV pages", m + ["role", "pool", "owner"], registry=r)
        self.prompt_tokens = Counter("dflash_prompt_tokens", "Prompt tokens processed", m, registry=r)
        self.generation_tokens = Counter("dflash_generation_tokens", "Tokens generated", m, registry=r)
        self.request_success = Counter("dflash_request_success", "Requests finished", m + ["finished_reason"],
                                       registry=r)
        self.ttft = Histogram("dflash_time_to_first_token_seconds", "Time to first token", m, buckets=TTFT_BUCKETS,
                              registry=r)
        self.itl = Histogram("dflash_inter_token_latency_seconds", "Time between streamed tokens", m,
                             buckets=ITL_BUCKETS, registry=r)
        self.tpot = Histogram("dflash_time_per_output_token_seconds", "Decode time per output token", m,
                              buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("dflash_e2e_request_latency_seconds", "End-to-end request latency", m,
                             buckets=E2E_BUCKETS, registry=r)
        self.transfers = Counter("dflash_kv_transfers", "Prefill-to-decode KV transfers", m, registry=r)
        self.transfer_failures = Counter("dflash_kv_transfer_failures", "KV transfers that failed", m, registry=r)
        self.transfer_bytes = Counter("dflash_kv_transfer_bytes", "Bytes moved by KV transfers", m, registry=r)
        self.transfer_latency = Histogram("dflash_kv_transfer_latency_seconds", "NIXL READ latency", m,
                                          buckets=TRANSFER_BUCKETS, registry=r)
        self.drafts = Counter("dflash_spec_decode_num_drafts", "Verification steps that carried drafts", m,
                              registry=r)
        self.draft_tokens = Counter("dflash_spec_decode_num_draft_tokens", "Draft tokens proposed", m, registry=r)
        self.accepted_tokens = Counter("dflash_spec_decode_num_accepted_tokens", "Draft tokens accepted", m,
                                       registry=r)
        self.accepted_per_pos = Counter("dflash_spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each block position", m + ["position"], registry=r)

    # --- per request, from the ingress --------------------------------------------------------
    def observe_finished(self, *, num_prompt_tokens: int, num_generated: int, finish_reason: str, ttft: float | None,
                         e2e: float, spec: dict | None, token_gaps: list[float] = ()) -> None:
        name = self.model_name
        self.prompt_tokens.labels(name).inc(num_prompt_tokens)
        self.generation_tokens.labels(name).inc(num_generated)
        self.request_success.labels(name, finish_reason).inc()
        self.e2e.labels(name).observe(e2e)
        for gap in token_gaps:
            self.itl.labels(name).observe(gap)
        if ttft is not None:
            self.ttft.labels(name).observe(ttft)
            if num_generated > 1:
                self.tpot.labels(name).observe((e2e - ttft) / (num_generated - 1))
        if spec and spec.get("num_drafts"):
            self.drafts.labels(name).inc(spec["num_drafts"])
            self.draft_tokens.labels(name).inc(spec["num_draft_tokens"])
            self.accepted_tokens.labels(name).inc(spec["num_accepted_tokens"])
            for position, count in enumerate(spec.get("accepted_per_position", [])):
                self.accepted_per_pos.labels(name, str(position)).inc(count)

    def observe_transfer(self, stats: dict | None, failed: bool = False) -> None:
        if failed:
            self.transfer_failures.labels(self.model_name).inc()
        elif stats:
            self.transfers.labels(self.model_name).inc()
            self.transfer_bytes.labels(self.model_name).inc(stats["bytes"])
            self.transfer_latency.labels(self.model_name).observe(stats["seconds"])

    # --- per scrape, from the hub ---------------------------------------------------------------
    def load_snapshots(self, snapshots: dict[str, dict]) -> None:
        """Replace the replica gauges with the sums over the live replicas' snapshots."""
        for gauge in (self.running, self.waiting, self.replicas, self.pages_in_use, self.pages_total):
            gauge.clear()
        name = self.model_name
        for snap in snapshots.values():
            role = snap["role"]
            self.replicas.labels(name, role).inc()
            self.running.labels(name, role).inc(snap["running"])
            self.waiting.labels(name, role).inc(snap["waiting"])
            for pool in snap["pools"]:
                labels = (name, role, str(pool["pool"]), pool["owner"])
                self.pages_in_use.labels(*labels).inc(pool["in_use"])
                self.pages_total.labels(*labels).inc(pool["total"])

    def render(self) -> bytes:
        return generate_latest(self.registry)


def engine_snapshot(engine, role: str, num_awaiting_transfer: int = 0) -> dict:
    """What a replica reports (run on its engine thread): batch sizes and pages per pool and owner."""
    kv = engine.kv
    pools = []
    for i, pool in enumerate(kv.pools):
        owners = "+".join(o for o in ("target", "draft") if any(s.owner.value == o for s in pool.specs))
        pools.append({"pool": i, "owner": owners, "in_use": kv.pages_in_use(i), "total": pool.num_pages})
    return {"role": role, "running": len(engine.scheduler.running),
            "waiting": len(engine.scheduler.waiting) + num_awaiting_transfer, "pools": pools}
