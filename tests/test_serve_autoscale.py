"""Autoscaling: a burst raises the decode replicas within the configured bounds; idling lowers them again."""

import threading
import time

import httpx
import pytest

pytestmark = pytest.mark.ray

from ray import serve  # noqa: E402

from serve_app.app import build_app  # noqa: E402
from tests.test_serve_support import free_port, service_args, wait_healthy, write_tiny_pair  # noqa: E402

MIN_DECODE, MAX_DECODE = 1, 2
FAST = {"min_replicas": MIN_DECODE, "max_replicas": MAX_DECODE, "target_ongoing_requests": 1,
        "upscale_delay_s": 0.5, "downscale_delay_s": 3.0, "look_back_period_s": 1.0,
        "metrics_interval_s": 0.5}


@pytest.fixture(scope="module")
def server(ray_cluster, tmp_path_factory):
    target, drafter = write_tiny_pair(tmp_path_factory.mktemp("autoscale_pair"))
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(service_args(target, drafter, decode={"autoscaling": FAST})),
              name="scaled", route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url)
    yield url
    serve.shutdown()


def decode_replicas() -> int:
    """Replicas the controller runs or starts for the decode deployment."""
    deployment = serve.status().applications["scaled"].deployments["DecodeServer"]
    return sum(n for state, n in deployment.replica_states.items() if state in ("RUNNING", "STARTING"))


def test_burst_scales_decode_up_within_bounds_and_idle_scales_it_down(server):
    assert decode_replicas() == MIN_DECODE
    stop = threading.Event()
    statuses = []

    def load():
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 60, "temperature": 0, "ignore_eos": True}
        with httpx.Client(timeout=120) as c:
            while not stop.is_set():
                statuses.append(c.post(f"{server}/v1/completions", json=body).status_code)

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    seen = []
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            seen.append(decode_replicas())
            if seen[-1] >= MAX_DECODE:
                break
            time.sleep(0.5)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert max(seen) == MAX_DECODE, seen
    assert statuses and set(statuses) == {200}
    deadline = time.monotonic() + 90
    while decode_replicas() > MIN_DECODE:
        assert time.monotonic() < deadline, "idle decode replicas were not scaled down"
        seen.append(decode_replicas())
        time.sleep(0.5)
    assert max(seen) <= MAX_DECODE and decode_replicas() == MIN_DECODE
    assert httpx.get(f"{server}/health", timeout=10).status_code == 200
