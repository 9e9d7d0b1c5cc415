"""The invariants on the path users reach: the demo pair through HTTP, aggregated vs disaggregated vs the ablation.

Three applications on one Serve instance (one aggregated replica; one prefill and one decode replica; the
same without the draft-layer transfer), requests one at a time so every engine sees the same batch shapes.
"""

import json
import time
from pathlib import Path

import httpx
import pytest
from ray import serve

from serve_app.app import build_app
from tests.test_serve_support import free_port, wait_healthy

pytestmark = pytest.mark.ray

REPO = Path(__file__).resolve().parents[1]
APPS = {"agg": {"mode": "aggregated"}, "disagg": {"mode": "disaggregated"},
        "ablate": {"mode": "disaggregated", "transfer_draft_kv": False}}


def demo_args(overrides: dict) -> dict:
    engine = {"num_cpus": 0.25}
    return {"model": {"served_model_name": "demo", "num_pages": 128},
            "ingress": {"num_replicas": 1, "num_cpus": 0.1}, "aggregated": dict(engine), "prefill": dict(engine),
            "decode": dict(engine), "metrics_report_interval_s": 0.2, **overrides}


@pytest.fixture(scope="module")
def demo_service(ray_cluster):
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"
    for name, overrides in APPS.items():
        serve._run(build_app(demo_args(overrides)), _blocking=False, name=name, route_prefix=f"/{name}")
    for name in APPS:
        wait_healthy(f"{url}/{name}", timeout_s=240)
    yield url
    serve.shutdown()


def heldout_prompts(n: int = 4) -> list[str]:
    lines = (REPO / "benchmarks" / "prompts" / "heldout.jsonl").read_text().splitlines()
    return [json.loads(line)["prompt"] for line in lines[:n]]


def complete(url: str, prompt: str) -> tuple[list[int], list[int]]:
    """Greedy token ids and per-step acceptance lengths of one request (the response's usage)."""
    body = {"model": "demo", "prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["usage"]["completion_tokens"] == 40
    return data["choices"][0]["token_ids"], data["usage"]["spec_decode"]["acceptance_lengths"][0]


def pages_in_use(url: str) -> float:
    from tests.test_serve_support import metric_samples, metric_sum
    return metric_sum(metric_samples(httpx.get(f"{url}/metrics", timeout=30).text), "dflash_kv_pages_in_use")


def test_disaggregated_equals_aggregated_and_the_ablation_lowers_acceptance_over_http(demo_service):
    results = {name: [complete(f"{demo_service}/{name}", p) for p in heldout_prompts()] for name in APPS}
    agg, disagg, ablate = results["agg"], results["disagg"], results["ablate"]
    assert [tokens for tokens, _ in disagg] == [tokens for tokens, _ in agg]
    assert [als for _, als in disagg] == [als for _, als in agg]          # per step, not only on average
    assert [tokens for tokens, _ in ablate] == [tokens for tokens, _ in agg]  # lossless without the draft KV too

    def mean_al(rows):
        steps = [al for _, als in rows for al in als]
        return sum(steps) / len(steps)

    assert mean_al(agg) > 2.0                          # a trained drafter
    assert mean_al(ablate) < mean_al(disagg) - 0.05    # the problem the unified pool solves
    deadline = time.monotonic() + 10
    while any(pages_in_use(f"{demo_service}/{name}") for name in APPS) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [pages_in_use(f"{demo_service}/{name}") for name in APPS] == [0, 0, 0]
