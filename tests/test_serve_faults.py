"""Faults on the disaggregated service (two ingress replicas, whose /metrics must agree; a TP 2 decode replica):
SIGKILL of the real processes (decode replica, which hosts its rank-0 worker; its rank-1 worker, met in the
middle of a collective; decode KV manager; prefill replica; prefill KV manager). Each time: the streams in flight
(greedy, and seeded sampling) end with their full output, the answer they give alone (those whose decode replica lost
a process go on from the tokens they gave out, on the prefill replica: continued, or replayed and what the client
has dropped); meanwhile the other role's replicas run new requests whole, with the
same output, within WHOLE_S of the kill, and /health says ``degraded`` within DEGRADED_S (never 503: a role still
serves) until the role has a healthy replica again, within RECOVERY_S; no page stays in use."""

import json
import os
import re
import signal
import threading
import time

import httpx
import pytest

pytestmark = pytest.mark.ray

import ray  # noqa: E402
from ray import serve  # noqa: E402

from serve_app.ingress import HEALTH_HUB_WAIT_S  # noqa: E402
from serve_app.router import DOWN_S  # noqa: E402
from tests.test_serve_support import metric_samples, metric_sum, tiny_service, wait_healthy  # noqa: E402

# Serve's health check notices (a few seconds), then a replica starts cold: a Ray worker process, imports (torch,
# Serve), the model and a KV manager process. On 2 cores that run the whole service beside the tests this took
# 15-28 s; a service that never recovers fails all the same.
RECOVERY_S = 60.0
# A stream whose decode replica lost a process goes on elsewhere within this: the replica fails its streams within
# its next metrics report (0.2 s here), not after Serve's graceful-shutdown wait (20 s) or the end of the stream, and
# the ingress sends it on after RETRY_PAUSES_S[0].
RESUME_S = 10.0
STREAM_TOKENS = 320     # decoding takes seconds here: the streams are still decoding when the process dies
# /health says ``degraded`` within this of the kill (0.33-0.35 s here). A process killed says nothing: its replica
# finds a dead rank at its next report (0.2 s here), and a replica's own death ends its rank-0 engine process, on
# which the metrics hub holds a call (``MetricsHub.watch``). Without that lifeline a killed prefill replica stayed
# listed until its reports went stale (2.6 s here: ``/health`` said degraded 2.73 s after the kill).
DEGRADED_S = 2.0
# A request made after the kill is served whole by the other role within this (0.6-2.2 s here; a replacement takes
# longer, and the test checks the request ran whole): its first try may meet the dead replica, or wait for it until
# the router sees the role down (the hub drops a dead replica at once; the router looks every ``WATCH_S``), and is
# sent again (``serve_app.ingress.RETRY_PAUSES_S``), now whole.
WHOLE_S = 15.0
# What a client must never see: process ids, addresses, actor ids, ANSI escapes, tracebacks, Ray's class names.
INTERNALS = re.compile(r"pid=|\b\d+\.\d+\.\d+\.\d+\b|[0-9a-f]{24,}|\x1b\[|Traceback|Ray[A-Za-z]*Error|ActorDied|"
                       r"prefill-[0-9a-f]{8}|decode-[0-9a-f]{8}")


@pytest.fixture(scope="module")
def server(ray_cluster, tmp_path_factory):
    fast_checks = {"health_check_period_s": 1.0, "health_check_timeout_s": 5.0}
    with tiny_service(tmp_path_factory.mktemp("faults_pair"), prefill=fast_checks, hold_timeout_s=15.0,
                      decode={**fast_checks, "tensor_parallel_size": 2}, ingress={"num_replicas": 2}) as url:
        yield url


def alive_actor(role: str, kind: str) -> tuple[str, int]:
    """(name, pid) of the live actor of ``role`` ("prefill"/"decode") and ``kind`` ("replica"/"kv_manager"/
    "engine": the worker of rank 0, the engine's process/"follower": the worker of rank 1).

    Serve names its replica actors ``SERVE_REPLICA::<app>#<deployment>#<id>``; KV managers are named
    ``<role>-<id>-rank<r>``, rank workers ``<role>-<id>-rank<r>-worker``."""
    import ray

    server_class = {"prefill": "PrefillServer", "decode": "DecodeServer"}[role]
    found = []
    for actor in ray.util.list_named_actors(all_namespaces=True):
        name = actor["name"]
        pattern = {"kv_manager": rf"{role}-[0-9a-f]{{8}}-rank0", "engine": rf"{role}-[0-9a-f]{{8}}-rank0-worker",
                   "follower": rf"{role}-[0-9a-f]{{8}}-rank1-worker"}
        if (name.startswith("SERVE_REPLICA::") and f"#{server_class}#" in name) if kind == "replica" else \
                re.fullmatch(pattern[kind], name):
            handle = ray.get_actor(name, namespace=actor["namespace"])
            try:
                found.append((name, ray.get(handle.__ray_call__.remote(lambda self: os.getpid()), timeout=10)))
            except ray.exceptions.RayError:     # a dead one still listed, or one being stopped
                pass
    assert len(found) == 1, found
    return found[0]


def hub_pid() -> int:
    """The process of the application's metrics hub (Serve's replica actor ``...#MetricsHub#<id>``)."""
    import ray

    names = [(a["name"], a["namespace"]) for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith("SERVE_REPLICA::") and "#MetricsHub#" in a["name"]]
    assert len(names) == 1, names
    return ray.get(ray.get_actor(*names[0]).__ray_call__.remote(lambda self: os.getpid()), timeout=10)


LONG = {"greedy": {"model": "tiny", "prompt": "a", "max_tokens": STREAM_TOKENS, "temperature": 0, "ignore_eos": True}}
LONG["seeded"] = {**LONG["greedy"], "temperature": 0.8, "seed": 5}


@pytest.fixture(scope="module")
def long_answers(server) -> dict[str, str]:
    """Each long request's answer alone, before any kill."""
    return {kind: httpx.post(f"{server}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
            for kind, body in LONG.items()}


def stream_events(url: str, kind: str, started: threading.Event, out: dict) -> None:
    """The long request of ``kind``, streamed; ``out`` gets its data events, when each came, and how it ended."""
    events, times = out.setdefault("events", []), out.setdefault("times", [])
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json={**LONG[kind], "stream": True}, timeout=120) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    times.append(time.monotonic())
                    if len(events) >= 3:      # past the prefill's early first token: decoding
                        started.set()
    except httpx.HTTPError as e:
        out["transport_error"] = repr(e)
    finally:
        out["ended"] = time.monotonic()
        started.set()


def check_ending(out: dict, answer: str) -> None:
    """The stream ended with the whole answer, no error event among its events."""
    assert "transport_error" not in out, out
    assert out["status"] == 200 and out["events"][-1] == "[DONE]", out
    events = [json.loads(e) for e in out["events"][:-1]]
    assert [e for e in events if "error" in e] == [], "a stream in flight ended in an error"
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(e["choices"][0]["text"] for e in events) == answer


def whole_count(url: str, role: str) -> float:
    """Requests run whole on ``role``'s replicas, as /metrics says."""
    return metric_sum(metric_samples(httpx.get(f"{url}/metrics", timeout=30).text), "dflash_requests_run_whole_total",
                      role=role)


def resumes(url: str) -> float:
    return metric_sum(metric_samples(httpx.get(f"{url}/metrics", timeout=30).text), "dflash_request_resumes_total")


def pages_in_use(url: str) -> float:
    return metric_sum(metric_samples(httpx.get(f"{url}/metrics", timeout=30).text), "dflash_kv_pages_in_use")


@ray.remote(num_cpus=0)
class HubReader:
    async def snapshots(self) -> dict:
        return await serve.get_deployment_handle("MetricsHub", "dflash").snapshots.remote()


def test_metrics_of_any_ingress_count_the_requests_of_every_ingress(server):
    from concurrent.futures import ThreadPoolExecutor

    def finished(text: str) -> float:
        return metric_sum(metric_samples(text), "dflash_request_success_total")

    before = finished(httpx.get(f"{server}/metrics", timeout=30).text)
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    with ThreadPoolExecutor(8) as pool:
        assert {r.status_code for r in pool.map(lambda _: httpx.post(f"{server}/v1/completions", json=body,
                                                                      timeout=60), range(16))} == {200}
    # Right away, whichever ingress answers: one may not have reported its last requests yet, but the totals
    # never go back from one scrape to the next (each ingress serves the hub's view, its own reported first).
    seen = [finished(httpx.get(f"{server}/metrics", timeout=30).text) for _ in range(8)]
    assert seen == sorted(seen) and seen[-1] <= before + 16, seen
    time.sleep(1.0)       # every ingress has reported since (every 0.2 s)
    # The hub's view, asked from an async actor: in Serve's throughput mode a handle routes its calls on the event
    # loop it was first used on, which must live as long as the handle (this test process has none).
    reader = HubReader.remote()
    try:
        snapshots = ray.get(reader.snapshots.remote(), timeout=30)
    finally:
        ray.kill(reader)
    per_ingress = [finished(s["metrics"]) for s in snapshots.values() if s["role"] == "ingress"]
    assert len(per_ingress) == 2 and sum(per_ingress) == before + 16
    assert min(per_ingress) > 0, per_ingress      # both served some: one ingress's page alone would be short
    for _ in range(6):     # whichever ingress answers the scrape
        assert finished(httpx.get(f"{server}/metrics", timeout=30).text) == before + 16


def test_health_answers_while_the_metrics_hub_hangs(server):
    """/health asks the metrics hub, and a load balancer's probe gives it a second or two. A hub that hangs
    (SIGSTOP to its process: a real hang), or that Serve is replacing after a crash (6-10 s on 2 cores), does not
    stop the service serving, so /health answers after HEALTH_HUB_WAIT_S from the hub's last answer and says so;
    once the hub runs again it answers afresh. Before, /health waited for the hub for as long as it hung."""
    wait_healthy(server)
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    alone = httpx.post(f"{server}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    pid = hub_pid()
    os.kill(pid, signal.SIGSTOP)
    try:
        for _ in range(4):      # (two ingresses: either may answer)
            asked = time.monotonic()
            r = httpx.get(f"{server}/health", timeout=HEALTH_HUB_WAIT_S + 5)
            assert time.monotonic() - asked < HEALTH_HUB_WAIT_S + 3
            assert (r.status_code, r.json()) == (200, {"status": "ok", "message": "the metrics hub did not answer; "
                                                                                   "its last answer stands"})
        r = httpx.post(f"{server}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == alone
    finally:
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 30
    while (r := httpx.get(f"{server}/health", timeout=30)).json() != {"status": "ok"}:
        assert time.monotonic() < deadline, r.json()
        time.sleep(0.2)
    assert hub_pid() == pid       # the same hub, running again


@pytest.mark.parametrize("role,kind", [("decode", "replica"), ("decode", "engine"), ("decode", "follower"),
                                       ("decode", "kv_manager"), ("prefill", "replica"), ("prefill", "engine"),
                                       ("prefill", "kv_manager")])
def test_killed_process_is_replaced_and_service_recovers(server, long_answers, role, kind):
    wait_healthy(server)
    other = {"prefill": "decode", "decode": "prefill"}[role]
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    alone = httpx.post(f"{server}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    whole_before, resumed_before = whole_count(server, other), resumes(server)
    victim = alive_actor(role, kind)
    # Two long streams, decoding when the process dies.
    outs, threads = [], []
    for sampling in LONG:
        started, out = threading.Event(), {"kind": sampling}
        t = threading.Thread(target=stream_events, args=(server, sampling, started, out), daemon=True)
        t.start()
        assert started.wait(60)
        outs.append(out)
        threads.append(t)
    os.kill(victim[1], signal.SIGKILL)
    killed = time.monotonic()

    # /health says degraded while the role has no healthy replica, and a request is served whole at once.
    health: list[tuple[float, int, dict]] = []
    polling = threading.Event()

    def poll_health():
        while not polling.is_set():
            r = httpx.get(f"{server}/health", timeout=10)
            health.append((time.monotonic() - killed, r.status_code, r.json()))
            time.sleep(0.25)

    poller = threading.Thread(target=poll_health, daemon=True)
    poller.start()
    try:
        while True:
            assert time.monotonic() - killed < WHOLE_S, f"no request succeeded within {WHOLE_S:.0f} s of the kill"
            r = httpx.post(f"{server}/v1/completions", json=body, timeout=WHOLE_S)
            if r.status_code == 200:
                assert r.json()["choices"][0]["text"] == alone
                print(f"{role} {kind}: a request succeeded {time.monotonic() - killed:.1f} s after the kill")
                break
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
            assert not INTERNALS.search(r.json()["error"]["message"]), r.text
            time.sleep(0.25)
        deadline = time.monotonic() + 5      # (its ingress reports every 0.2 s)
        while whole_count(server, other) <= whole_before:
            assert time.monotonic() < deadline, f"the request was not run whole on the {other} replica"
            time.sleep(0.2)
        while not any(b.get("status") == "degraded" for _, _, b in health):
            assert time.monotonic() - killed < WHOLE_S, f"/health kept answering ok after the kill: {health[-3:]}"
            time.sleep(0.1)
        wait_healthy(server, timeout_s=RECOVERY_S - (time.monotonic() - killed))
    finally:
        polling.set()
        poller.join()
    assert [h for h in health if h[1] != 200] == [], "/health answered 503 while a role could serve"
    first_degraded = min(t for t, _, b in health if b["status"] == "degraded")
    print(f"{role} {kind}: /health said degraded {first_degraded:.2f} s after the kill")
    assert first_degraded < DEGRADED_S, f"/health said degraded only {first_degraded:.1f} s after the kill"
    degraded = [b for _, _, b in health if b["status"] == "degraded"]
    assert all(b["unavailable"] == [role] for b in degraded), degraded
    # Past the window, the role serves again as before: the request goes the disaggregated way.
    time.sleep(DOWN_S)
    whole = whole_count(server, other)
    assert httpx.post(f"{server}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"] == alone
    time.sleep(1.0)
    assert whole_count(server, other) == whole, "a request ran whole after the role had recovered"

    for t, out in zip(threads, outs):
        t.join(60)
        assert not t.is_alive(), "a request in flight hangs after the kill"
        check_ending(out, long_answers[out["kind"]])
        stall = max(b - a for a, b in zip(out["times"], out["times"][1:]))
        assert stall < RESUME_S, f"a stream stalled {stall:.1f} s"
    if role == "decode":        # both streams went on elsewhere (the prefill replica) from what they gave out
        assert resumes(server) - resumed_before == 2
    else:                       # decoding already, they did not need the prefill side
        assert resumes(server) == resumed_before

    # A fresh replica replaced the victim, and nothing leaked on the side that survived.
    assert alive_actor(role, kind) != victim
    deadline = time.monotonic() + 20
    while pages_in_use(server) != 0:
        assert time.monotonic() < deadline, "pages stayed in use after the kill"
        time.sleep(0.3)
    samples = metric_samples(httpx.get(f"{server}/metrics", timeout=30).text)
    assert metric_sum(samples, "dflash_num_replicas", role="prefill") == 1
    assert metric_sum(samples, "dflash_num_replicas", role="decode") == 1
