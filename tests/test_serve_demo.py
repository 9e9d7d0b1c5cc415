"""The invariants on the path users reach: the demo pair through HTTP, aggregated vs disaggregated vs the ablation.

Four applications on one Serve instance (one aggregated replica; one prefill and one decode replica; the
same without the draft-layer transfer; a prefill replica of TP 1 feeding a decode replica of TP 2, whose ranks
READ one kv head each), requests one at a time so every engine sees the same batch shapes.
"""

import json
import re
from pathlib import Path

import httpx
import pytest
from ray import serve

from serve_app.app import build_app
from tests.test_serve_support import free_port, greedy_completion, wait_healthy, wait_pages_free

pytestmark = pytest.mark.ray

REPO = Path(__file__).resolve().parents[1]
APPS = {"agg": {"mode": "aggregated"}, "disagg": {"mode": "disaggregated"},
        "ablate": {"mode": "disaggregated", "transfer_draft_kv": False},
        "tp12": {"mode": "disaggregated", "decode": {"num_cpus": 0.25, "tensor_parallel_size": 2}}}


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


def test_disaggregated_equals_aggregated_and_the_ablation_lowers_acceptance_over_http(demo_service, ray_cluster):
    results = {name: [greedy_completion(f"{demo_service}/{name}", p) for p in heldout_prompts()] for name in APPS}
    agg, disagg, ablate = results["agg"], results["disagg"], results["ablate"]
    # The TP 2 decode replica runs a second rank, with its own KV manager (named <role>-<id>-rank<r>).
    names = [a["name"] for a in ray_cluster.util.list_named_actors(all_namespaces=True)]
    assert len([n for n in names if re.fullmatch(r"decode-[0-9a-f]{8}-rank1", n)]) == 1, names
    for split in (disagg, results["tp12"]):
        assert [tokens for tokens, _ in split] == [tokens for tokens, _ in agg]
        assert [als for _, als in split] == [als for _, als in agg]          # per step, not only on average
    assert [tokens for tokens, _ in ablate] == [tokens for tokens, _ in agg]  # lossless without the draft KV too

    def mean_al(rows):
        steps = [al for _, als in rows for al in als]
        return sum(steps) / len(steps)

    assert mean_al(agg) > 2.0                          # a trained drafter
    assert mean_al(ablate) < mean_al(disagg) - 0.05    # the problem the unified pool solves
    assert wait_pages_free([f"{demo_service}/{name}" for name in APPS]) == [0] * len(APPS)
