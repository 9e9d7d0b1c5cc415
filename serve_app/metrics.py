"""Prometheus metrics of the service, in vLLM's naming style with a ``dflash_`` prefix.

Request-level counters and histograms live in each ingress process (it sees every token go out). Engine
state that only the replicas know (requests running and waiting, KV pages in use, health) is pushed by each
replica to the application's ``MetricsHub`` deployment, and so is each ingress's own request metrics. A
scrape of any ingress renders the sum over every live ingress plus the replicas' gauges: with several ingress
replicas /metrics still counts every request. The hub is part of the Serve application, so it goes away with
it (``serve shutdown``, ``serve.delete``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from actors.cpus import leave_engine_cpus
from actors.logs import configure_actor_logging

log = logging.getLogger(__name__)

# ``_created`` samples are timestamps: they cannot be summed over ingress replicas.
prometheus_client.disable_created_metrics()

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)
HANDOFF_PHASES = ("reserve", "settle", "read", "start")     # EngineHost._take_over's, in order
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
STALE_REPORTS = 3      # a replica that missed this many reports in a row is gone (scaled down or dead) ...
STALE_GRACE_S = 2.0    # ... plus this long: a loaded host delays a report thread by a second or more
GONE_KEPT = 1024       # how many gone reporters the hub remembers (their late reports ignored)


class MetricsHub:
    """Latest snapshot of every live engine replica and ingress (a Serve deployment of the application).

    An engine replica's snapshot: ``role``, ``healthy``, batch sizes and pages per pool. An ingress's:
    ``role: "ingress"`` and its request metrics in Prometheus text. Each carries ``interval_s``, its report
    period: one that missed ``STALE_REPORTS`` reports (and ``STALE_GRACE_S`` more) is gone (scaled down or dead).
    A replica that lost a rank says so itself at once (``healthy: False``). A replica that is killed says nothing,
    so each also gives the hub a lifeline (``watch``): when its process dies, the hub knows within milliseconds,
    not after the staleness window (2.6 s at 0.2 s reports), and the ingresses route around it that much sooner."""

    def __init__(self, clock=time.monotonic):
        configure_actor_logging()
        leave_engine_cpus()
        self._clock = clock
        self._snapshots: dict[str, tuple[float, dict]] = {}
        self._watches: dict[str, asyncio.Task] = {}
        self._gone: dict[str, None] = {}     # reporters whose lifeline broke, oldest first (``GONE_KEPT``)

    def report(self, reporter: str, snapshot: dict) -> None:
        """Keep the reporter's latest snapshot; one that carries a ``seq`` older than the kept one's (an ingress's
        reports sent from two threads may arrive out of order) only says the reporter is alive. A report from a
        reporter whose lifeline broke (sent before its process died) is ignored."""
        if reporter in self._gone:
            return
        kept = self._snapshots.get(reporter)
        if kept is not None and snapshot.get("seq", 0) < kept[1].get("seq", 0):
            snapshot = kept[1]
        self._snapshots[reporter] = (self._clock(), snapshot)

    def forget(self, reporter: str) -> None:
        self._snapshots.pop(reporter, None)
        watch = self._watches.pop(reporter, None)
        if watch is not None:
            watch.cancel()

    async def watch(self, reporter: str, lifeline) -> None:
        """Watch ``reporter``'s process through ``lifeline``: an actor whose fate it shares (one it owns, which
        Ray ends with it), with a ``lifeline`` method that never returns (``actors.worker.Lifeline``). When that
        call fails because the actor died, the reporter is gone at once: its snapshot dropped, its later reports
        ignored. The reporter sends this again now and then (a hub that was replaced knows nothing of it); while
        the watch is on, that does nothing. Any other failure of the call (the actor unreachable for a moment)
        only ends the watch: the reports' staleness still holds, and the next ``watch`` starts it again."""
        if reporter in self._gone or reporter in self._watches:
            return
        self._watches[reporter] = asyncio.ensure_future(self._watch(reporter, lifeline))

    async def _watch(self, reporter: str, lifeline) -> None:
        from ray.exceptions import ActorDiedError

        try:
            await lifeline.lifeline.remote()
        except ActorDiedError:
            role = self._snapshots.pop(reporter, (0.0, {}))[1].get("role")
            self._gone[reporter] = None
            while len(self._gone) > GONE_KEPT:
                del self._gone[next(iter(self._gone))]
            log.warning("%s%s is gone: its process died", reporter, f" ({role})" if role else "")
        except Exception as e:      # not known dead: the staleness window decides
            log.warning("lost the lifeline of %s (%s: %s); its reports still tell", reporter, type(e).__name__, e)
        finally:
            self._watches.pop(reporter, None)

    def snapshots(self) -> dict[str, dict]:
        now = self._clock()
        stale = [r for r, (t, snap) in self._snapshots.items()
                 if now - t > STALE_REPORTS * snap["interval_s"] + STALE_GRACE_S]
        for reporter in stale:
            del self._snapshots[reporter]
        return {reporter: snap for reporter, (_, snap) in self._snapshots.items()}


class HubClient:
    """The hub's handle for a process's reporter thread. Serve may bind a handle to the event loop of the replica's
    user code (its router runs on that loop in Serve's throughput-optimized mode, and a call from another thread
    fails there), so calls made off that loop are handed to it. Made in the replica's constructor, which Serve runs
    on that loop; made outside any loop (a replica built directly), calls go out from the calling thread."""

    def __init__(self, hub):
        self.hub = hub
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None

    def report(self, reporter: str, snapshot: dict) -> None:
        self._send(lambda: self.hub.report.remote(reporter, snapshot))

    def forget(self, reporter: str) -> None:
        self._send(lambda: self.hub.forget.remote(reporter))

    def watch(self, reporter: str, lifeline) -> None:
        self._send(lambda: self.hub.watch.remote(reporter, lifeline))

    def _send(self, call) -> None:
        loop = self._loop
        if loop is None:
            call()
            return
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            call()
        elif not loop.is_closed():      # a closed loop: the replica is gone, and its reports with it
            loop.call_soon_threadsafe(call)


def merge_exposition(texts: list[str]) -> list[Metric]:
    """Prometheus text pages of several processes as one set of families, each sample summed over them."""
    families: dict[str, Metric] = {}
    sums: dict[str, dict[tuple, float]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            families.setdefault(family.name, Metric(family.name, family.documentation, family.type, family.unit))
            acc = sums.setdefault(family.name, {})
            for sample in family.samples:
                key = (sample.name, tuple(sample.labels.items()))
                acc[key] = acc.get(key, 0.0) + sample.value
    for name, family in families.items():
        for (sample_name, labels), value in sums[name].items():
            family.add_sample(sample_name, dict(labels), value)
    return list(families.values())


class _Families:
    """A collector of fixed metric families (the merged ingress metrics of one scrape)."""

    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self):
        return iter(self.families)


class ServiceMetrics:
    """The ingress's registry: request metrics observed here, replica gauges filled from the hub per scrape."""

    def __init__(self, model_name: str, roles: Sequence[str] = ()):
        self.model_name = model_name
        self.roles = tuple(roles)      # the service's engine roles: each appears in the replica gauges, 0 if none
        self._seq = 0
        self._report_lock = threading.Lock()
        m = ["model_name"]
        # Replica gauges: filled from the hub at each scrape.
        self.replica_registry = r = CollectorRegistry()
        self.running = Gauge("dflash_num_requests_running", "Requests in an engine's running batch", m + ["role"],
                             registry=r)
        self.waiting = Gauge("dflash_num_requests_waiting", "Requests waiting for a batch slot or their KV transfer",
                             m + ["role"], registry=r)
        self.replicas = Gauge("dflash_num_replicas", "Healthy engine replicas reporting", m + ["role"], registry=r)
        self.pages_in_use = Gauge("dflash_kv_pages_in_use", "KV pages in use", m + ["role", "pool", "owner"],
                                  registry=r)
        self.pages_total = Gauge("dflash_kv_pages_total", "KV pages", m + ["role", "pool", "owner"], registry=r)
        # Request metrics of this ingress: summed with the other ingresses' at each scrape.
        self.registry = r = CollectorRegistry()
        self.prompt_tokens = Counter("dflash_prompt_tokens", "Prompt tokens processed", m, registry=r)
        self.prefix_cache_hits = Counter("dflash_prefix_cache_hit_tokens", "Prompt tokens taken from the prefix cache "
                                         "(the prefill replica's, disaggregated) instead of computed", m, registry=r)
        self.generation_tokens = Counter("dflash_generation_tokens", "Tokens generated", m, registry=r)
        self.request_success = Counter("dflash_request_success", "Requests finished", m + ["finished_reason"],
                                       registry=r)
        # error_type: the error's ("overloaded", "transfer_error", "server_error", ...); never counted as a success
        self.request_errors = Counter("dflash_request_errors", "Requests that ended in an error", m + ["error_type"],
                                      registry=r)
        # A request sent again because a replica failed (``serve_app.ingress.RETRY_PAUSES_S``): from the start, or
        # going on from the tokens it gave out (also counted in request_resumes)
        self.request_retries = Counter("dflash_request_retries", "Requests sent again after a replica failed",
                                       m + ["error_type"], registry=r)
        self.request_resumes = Counter("dflash_request_resumes", "Streams that went on from the tokens they had "
                                       "given out, on another replica, after theirs failed", m, registry=r)
        # A disaggregated service's request run whole (prompt and decode) on a replica of ``role`` while the other
        # role could not serve (``serve_app.router``)
        self.requests_whole = Counter("dflash_requests_run_whole", "Requests run whole on one role's replica while "
                                      "the other role had no replica that could serve", m + ["role"], registry=r)
        self.ttft = Histogram("dflash_time_to_first_token_seconds", "Time to first token", m, buckets=TTFT_BUCKETS,
                              registry=r)
        self.itl = Histogram("dflash_inter_token_latency_seconds", "Time between streamed tokens", m,
                             buckets=ITL_BUCKETS, registry=r)
        self.tpot = Histogram("dflash_time_per_output_token_seconds", "Decode time per output token", m,
                              buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("dflash_e2e_request_latency_seconds", "End-to-end request latency", m,
                             buckets=E2E_BUCKETS, registry=r)
        # Inside the engines (prefill's for queue and prefill when disaggregated): what of TTFT and E2E is the
        # engine's, the rest being the serving path's.
        self.queue_time = Histogram("dflash_request_queue_time_seconds", "Time a request waited to be scheduled",
                                    m, buckets=TTFT_BUCKETS, registry=r)
        self.prefill_time = Histogram("dflash_request_prefill_time_seconds", "Time from a request's first scheduled "
                                      "step to its first token", m, buckets=TTFT_BUCKETS, registry=r)
        self.decode_time = Histogram("dflash_request_decode_time_seconds", "Time from a request's first token to "
                                     "its end", m, buckets=E2E_BUCKETS, registry=r)
        # path: "sink" (sent by an engine's process straight to this ingress), "replica" (relayed by a Serve stream)
        self.stream_chunks = Counter("dflash_stream_chunks", "Token chunks (and prefill results) this ingress "
                                     "received from the engines",
                                     m + ["path"], registry=r)
        # transport: "nixl" (READs), "ipc" (copies from a mapping of prefill pools on the same GPU)
        self.transfers = Counter("dflash_kv_transfers", "Prefill-to-decode KV transfers", m + ["transport"],
                                 registry=r)
        self.transfer_failures = Counter("dflash_kv_transfer_failures", "KV transfers that failed", m, registry=r)
        self.transfer_bytes = Counter("dflash_kv_transfer_bytes", "Bytes moved by KV transfers", m, registry=r)
        # Per transfer, NIXL descriptors posted (a run of pages in one pool group is one): transfers whose count
        # nears their pages x groups have scattered pages, and pay host time per descriptor.
        self.transfer_descriptors = Counter("dflash_kv_transfer_descriptors", "NIXL descriptors posted (or copies "
                                            "launched) by KV transfers", m, registry=r)
        self.transfer_latency = Histogram("dflash_kv_transfer_latency_seconds", "KV READ (or copy) latency", m,
                                          buckets=TRANSFER_BUCKETS, registry=r)
        # A decode take-over as a whole (the stall between a disaggregated request's first token and the rest), and
        # its phases inside the decode engine's process; the difference is routing and the crossings between
        # processes.
        self.handoff = Histogram("dflash_kv_handoff_seconds", "From a prefill's result at the ingress to the decode "
                                 "replica's first output there", m, buckets=TRANSFER_BUCKETS, registry=r)
        self.handoff_phase = Histogram("dflash_kv_handoff_phase_seconds", "A decode take-over's phases in the decode "
                                       "engine's process: reserve (waiting for pages), settle (waiting for the device "
                                       "to finish with them), read (lease checks and READs), start (the engine "
                                       "starting to decode)", m + ["phase"],
                                       buckets=TRANSFER_BUCKETS, registry=r)
        self.transfer_reused_pages = Counter("dflash_kv_transfer_reused_pages", "Prompt pages a decode replica took "
                                             "from its own prefix cache instead of READing them", m, registry=r)
        self.drafts = Counter("dflash_spec_decode_num_drafts", "Verification steps that carried drafts", m,
                              registry=r)
        self.draft_tokens = Counter("dflash_spec_decode_num_draft_tokens", "Draft tokens proposed", m, registry=r)
        self.accepted_tokens = Counter("dflash_spec_decode_num_accepted_tokens", "Draft tokens accepted", m,
                                       registry=r)
        self.accepted_per_pos = Counter("dflash_spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each block position", m + ["position"], registry=r)

    # --- per request, from the ingress --------------------------------------------------------
    def observe_finished(self, *, num_prompt_tokens: int, num_generated: int, finish_reason: str, ttft: float | None,
                         e2e: float, spec: dict | None, token_gaps: list[float] = (),
                         timing: dict | None = None, num_cached_tokens: int = 0, error: str | None = None) -> None:
        """One choice's end: ``finish_reason`` when it succeeded (or was aborted), else the type of its ``error``."""
        name = self.model_name
        if timing:
            self.queue_time.labels(name).observe(timing["queue_s"])
            self.prefill_time.labels(name).observe(timing["prefill_s"])
            self.decode_time.labels(name).observe(timing["decode_s"])
        self.prompt_tokens.labels(name).inc(num_prompt_tokens)
        self.prefix_cache_hits.labels(name).inc(num_cached_tokens)
        self.generation_tokens.labels(name).inc(num_generated)
        if error is None:
            self.request_success.labels(name, finish_reason).inc()
        else:
            self.request_errors.labels(name, error).inc()
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
            self.transfers.labels(self.model_name, stats.get("transport", "nixl")).inc()
            self.transfer_bytes.labels(self.model_name).inc(stats["bytes"])
            self.transfer_descriptors.labels(self.model_name).inc(stats.get("descriptors", 0))
            self.transfer_latency.labels(self.model_name).observe(stats["seconds"])
            self.transfer_reused_pages.labels(self.model_name).inc(stats.get("reused_pages", 0))
            if "handoff_s" in stats:
                self.handoff.labels(self.model_name).observe(stats["handoff_s"])
            for phase in HANDOFF_PHASES:
                if f"{phase}_s" in stats:
                    self.handoff_phase.labels(self.model_name, phase).observe(stats[f"{phase}_s"])

    # --- per scrape, from the hub ---------------------------------------------------------------
    def own_text(self) -> str:
        """This ingress's request metrics in Prometheus text."""
        return generate_latest(self.registry).decode()

    def report(self, interval_s: float) -> dict:
        """This ingress's snapshot for the hub: its request metrics, numbered (``seq`` grows with the counts)."""
        with self._report_lock:
            self._seq += 1
            return {"role": "ingress", "interval_s": interval_s, "metrics": self.own_text(), "seq": self._seq}

    def load_snapshots(self, snapshots: dict[str, dict]) -> None:
        """Replace the replica gauges with the sums over the live, healthy engine replicas' snapshots."""
        for gauge in (self.running, self.waiting, self.replicas, self.pages_in_use, self.pages_total):
            gauge.clear()
        name = self.model_name
        for role in self.roles:     # a role with no healthy replica reads 0, not nothing (alerts compare with it)
            for gauge in (self.replicas, self.running, self.waiting):
                gauge.labels(name, role).set(0)
        for snap in snapshots.values():
            role = snap["role"]
            if role == "ingress" or not snap.get("healthy", True):
                continue      # an ingress, or a replica with a dead rank (Serve is replacing it)
            self.replicas.labels(name, role).inc()
            self.running.labels(name, role).inc(snap["running"])
            self.waiting.labels(name, role).inc(snap["waiting"])
            for pool in snap["pools"]:
                labels = (name, role, str(pool["pool"]), pool["owner"])
                self.pages_in_use.labels(*labels).inc(pool["in_use"])
                self.pages_total.labels(*labels).inc(pool["total"])

    def render(self, snapshots: dict[str, dict]) -> bytes:
        """The whole page: every ingress's request metrics as the hub holds them, summed, and the replica gauges.
        An ingress reports its own first, so its counts are current; taking the others' and its own alike from
        the hub makes every ingress serve the same totals, which only grow from one scrape to the next whichever
        ingress answers (its own live counts beside the others' older reports would not: a counter that went
        back between two scrapes reads as a reset to Prometheus)."""
        self.load_snapshots(snapshots)
        texts = [s["metrics"] for s in snapshots.values() if s["role"] == "ingress"]
        merged = CollectorRegistry()
        merged.register(_Families(merge_exposition(texts)))
        loops = CollectorRegistry()
        loops.register(_Families(engine_loop_families(self.model_name, snapshots)))
        return generate_latest(merged) + generate_latest(self.replica_registry) + generate_latest(loops)


# The engine loops' cumulative times (``actors.engine_loop.LoopStats``), per role: name, help, the snapshot's key,
# and whether it is split by step kind.
LOOP_COUNTERS = (
    ("dflash_engine_steps", "Engine steps, by kind (prompt: the step computed prompt tokens)", "steps", True),
    ("dflash_engine_step_seconds", "Wall time of engine steps", "step_s", True),
    ("dflash_engine_step_cpu_seconds", "The engine thread's CPU time within its steps (the rest of a step's wall "
                                       "time it waited off the core)", "step_cpu_s", True),
    ("dflash_engine_idle_seconds", "Time an engine thread sat idle with no request to step", "idle_s", False),
    ("dflash_engine_device_wait_seconds", "Time engine threads waited within their steps for the device's results "
                                          "(CUDA's default wait spins, so this time counts as on the core)",
     "device_wait_s", False),
    ("dflash_engine_loop_seconds", "Time since the engine threads started", "uptime_s", False),
    ("dflash_engine_thread_cpu_seconds", "CPU time of the engine threads", "thread_cpu_s", False),
    ("dflash_engine_process_cpu_seconds", "CPU time of the engines' processes (the engine thread and the rest)",
     "process_cpu_s", False),
    ("dflash_num_preemptions", "Requests preempted by recompute when an engine's KV pages ran out (each recomputes "
                               "its prompt and output so far)", "preemptions", False),
)


def engine_loop_families(model_name: str, snapshots: dict[str, dict]) -> list[Metric]:
    """Counters of where the engine threads' time goes, summed per role over the healthy replicas reporting (a
    replica that goes away takes its share with it: a drop reads as a counter reset)."""
    sums: dict[tuple, float] = {}
    for snap in snapshots.values():
        loop = snap.get("loop") if snap.get("healthy", True) else None
        if not loop:
            continue
        for name, _, key, by_kind in LOOP_COUNTERS:
            values = loop[key].items() if by_kind else [(None, loop[key])]
            for kind, value in values:
                sums[(name, snap["role"], kind)] = sums.get((name, snap["role"], kind), 0.0) + value
    families = []
    for name, doc, _, by_kind in LOOP_COUNTERS:
        family = CounterMetricFamily(name, doc, labels=["model_name", "role"] + (["kind"] if by_kind else []))
        for (n, role, kind), value in sorted(sums.items(), key=lambda kv: (kv[0][1], kv[0][2] or "")):
            if n == name:
                family.add_metric([model_name, role] + ([kind] if by_kind else []), value)
        families.append(family)
    return families


def engine_snapshot(gauges: dict, role: str, interval_s: float) -> dict:
    """What a replica reports: its engine's gauges (``EngineHost.gauges``: batch sizes, pages per pool and owner),
    with requests awaiting pages or their transfer counted as waiting."""
    return {"role": role, "healthy": True, "interval_s": interval_s, "running": gauges["running"],
            "waiting": gauges["waiting"] + gauges.get("awaiting_transfer", 0), "pools": gauges["pools"],
            "loop": gauges.get("loop")}
