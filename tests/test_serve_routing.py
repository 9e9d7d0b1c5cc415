"""Prefix-affine routing (``serve_app/routing.py``): the disaggregated app with two prefill replicas and two ingress
replicas, each ingress with its own router. A repeated prompt, and the next turns of a conversation, reach the
prefill replica that holds its pages, whichever ingress takes them; the rendezvous ranking spreads prompts over the
replicas and moves only a departed replica's prompts. A prefill replica that lost its engine's process leaves at
once, and the requests it failed are sent again, to the other."""

import hashlib
import os
import re
import signal
import time

import httpx
import pytest

pytestmark = pytest.mark.ray

from serve_app.routing import PREFIX_TOKENS, rank  # noqa: E402
from tests.test_serve_support import CHUNK, metric_samples, metric_sum, tiny_service  # noqa: E402

PAGE = 16


@pytest.fixture(scope="module")
def server(ray_cluster, tmp_path_factory):
    # Two requests at a time per prefill replica: a third goes to the next replica in the prompt's ranking.
    # Serve's health checks of the engine replicas far apart: only a replica's own leaving takes it out of the
    # routing within the last tests' seconds.
    far = {"num_replicas": 2, "health_check_period_s": 60.0}
    with tiny_service(tmp_path_factory.mktemp("routing_pair"), ingress={"num_replicas": 2},
                      prefill={**far, "max_ongoing_requests": 2}, decode=far) as url:
        yield url


def complete(url: str, prompt: list[int]) -> dict:
    r = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()


def test_repeats_and_next_turns_reach_the_replica_holding_their_pages(server):
    # Replicas report their metrics every few seconds: the second may not have reported by the first health check.
    deadline = time.monotonic() + 30
    while metric_sum(metric_samples(httpx.get(f"{server}/metrics", timeout=30).text), "dflash_num_replicas",
                     role="prefill") != 2:
        assert time.monotonic() < deadline, "the app does not report 2 prefill replicas"
        time.sleep(0.2)
    # With two replicas and random routing, six repeats would all find the pages once in 32 runs.
    prompt = [4 + (7 * j + j * j) % 95 for j in range(2 * CHUNK + 5)]
    assert len(prompt) >= PREFIX_TOKENS          # its next turns share the tokens that decide the replica
    first = complete(server, prompt)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    full = (len(prompt) - 1) // PAGE * PAGE
    assert [complete(server, prompt)["usage"]["prompt_tokens_details"]["cached_tokens"] for _ in range(6)] == \
        [full] * 6
    # The next turns: the first turn, its answer and a new question each; all begin with the same PREFIX_TOKENS.
    answer = first["choices"][0]["token_ids"]
    for i in range(4):
        turn = prompt + answer + [5 + i] * (3 + i)
        assert complete(server, turn)["usage"]["prompt_tokens_details"]["cached_tokens"] >= full


def test_a_busy_preferred_replica_hands_requests_to_the_next(server):
    """Eight prompts that share their first tokens at once: the replica holding them takes two at a time, the rest go
    to the next replica in their ranking, which has not seen the prefix (the first there computes it all)."""
    from concurrent.futures import ThreadPoolExecutor

    shared = [4 + (11 * j + 3 * j * j) % 95 for j in range(PREFIX_TOKENS + 16)]
    complete(server, shared + [7])                             # its pages, on the replica the prefix prefers
    with ThreadPoolExecutor(8) as pool:
        cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"]
                  for r in pool.map(lambda i: complete(server, shared + [8 + i] * 20), range(8))]
    assert cached.count(len(shared)) >= 2 and min(cached) < len(shared), cached


def test_rendezvous_ranking_spreads_prompts_and_moves_only_a_departed_replicas():
    keys = [hashlib.blake2b(i.to_bytes(2, "little"), digest_size=16).digest() for i in range(600)]
    three = ["replica-a", "replica-b", "replica-c"]
    first = [three[rank(k, three)[0]] for k in keys]
    assert all(150 <= first.count(r) <= 250 for r in three), [first.count(r) for r in three]
    # Without replica-c, the prompts it won go to the others; no other prompt changes replica.
    two = ["replica-a", "replica-b"]
    after = [two[rank(k, two)[0]] for k in keys]
    assert all(a == b for a, b in zip(first, after) if a != "replica-c")
    assert sorted(rank(keys[0], three)) == [0, 1, 2]


def named_actors(pattern: str) -> dict[str, tuple]:
    """Name -> (handle, process id) of the live named actors whose name matches ``pattern``."""
    import ray

    found = {}
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if re.fullmatch(pattern, actor["name"]):
            try:
                handle = ray.get_actor(actor["name"], namespace=actor["namespace"])
                found[actor["name"]] = handle, ray.get(handle.__ray_call__.remote(lambda self: os.getpid()),
                                                       timeout=10)
            except (ValueError, ray.exceptions.RayError):     # gone since it was listed
                pass
    return found


def retries(url: str) -> float:
    return metric_sum(metric_samples(httpx.get(f"{url}/metrics", timeout=30).text), "dflash_request_retries_total")


def kill_and_wait_gone(role: str, pick=None) -> tuple[str, float]:
    """SIGKILL the engine process of one of ``role``'s two replicas (the first by name for which ``pick`` of its
    worker's handle is true); returns the name of that replica's KV manager and when it was killed."""
    workers = named_actors(rf"{role}-[0-9a-f]{{8}}-rank0-worker")
    assert len(workers) == 2, workers
    for name, (handle, pid) in sorted(workers.items()):
        if pick is None or pick(handle):
            break
    else:
        raise AssertionError(f"no {role} replica to kill")
    kv_manager = name.removesuffix("-worker")
    assert kv_manager in named_actors(rf"{role}-[0-9a-f]{{8}}-rank0")
    os.kill(pid, signal.SIGKILL)
    return kv_manager, time.monotonic()


def wait_gone(role: str, kv_manager: str, killed: float) -> None:
    """The killed replica has left (its KV manager, which it owns, with it) within seconds."""
    while kv_manager in named_actors(rf"{role}-[0-9a-f]{{8}}-rank0"):
        assert time.monotonic() - killed < 15, "the broken replica did not leave"
        time.sleep(0.2)


def wait_retried(url: str, before: float) -> None:
    deadline = time.monotonic() + 10      # the ingresses' counts reach the scrape through the metrics hub
    while retries(url) == before:
        assert time.monotonic() < deadline, "no request was sent again: none met the broken replica"
        time.sleep(0.2)


def test_a_prefill_replica_that_lost_its_engine_leaves_and_the_requests_it_failed_go_to_the_other(server):
    """Sixteen prompts at once right after one prefill replica's engine process was killed: about half rank that
    replica first. Each gets its answer from before the kill: those the broken replica failed are sent again
    (``dflash_request_retries_total``), and reach the other replica once the broken one has left, within seconds
    (its KV manager, which it owns, goes with it). Serve's health check would take it out only after a minute here,
    so without the leaving, or without the retries, some of the sixteen fail with a 503."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = [[4 + (13 * i + 5 * j + i * j) % 93 for j in range(24)] for i in range(16)]
    answers = [complete(server, p)["choices"][0]["token_ids"] for p in prompts]
    before = retries(server)
    kv_manager, killed = kill_and_wait_gone("prefill")
    with ThreadPoolExecutor(16) as pool:
        after = [r["choices"][0]["token_ids"] for r in pool.map(lambda p: complete(server, p), prompts)]
    assert after == answers
    wait_retried(server, before)
    wait_gone("prefill", kv_manager, killed)


def test_requests_not_streamed_start_over_when_their_decode_replica_loses_its_engine(server):
    """Six long requests, not streamed, decoding on the two decode replicas when the engine process of one that runs
    some of them is killed: each still gets its whole answer from before the kill (nothing of it had reached the
    client, so the ingress sent it again), and that replica leaves."""
    from concurrent.futures import ThreadPoolExecutor

    import ray

    def long(prompt: list[int]) -> list[int]:
        r = httpx.post(f"{server}/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": prompt, "max_tokens": 300, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    def decoding(worker) -> bool:
        return ray.get(worker.gauges.remote(), timeout=10)["running"] > 0

    prompts = [[4 + (7 * i + 3 * j) % 91 for j in range(12)] for i in range(6)]
    answers = [long(p) for p in prompts]
    before = retries(server)
    with ThreadPoolExecutor(6) as pool:
        running = [pool.submit(long, p) for p in prompts]
        deadline = time.monotonic() + 30
        while metric_sum(metric_samples(httpx.get(f"{server}/metrics", timeout=30).text),
                         "dflash_num_requests_running", role="decode") < 2:
            assert time.monotonic() < deadline, "the requests did not reach the decode replicas"
            time.sleep(0.1)
        kv_manager, killed = kill_and_wait_gone("decode", pick=decoding)
        assert [f.result() for f in running] == answers
    wait_retried(server, before)
    wait_gone("decode", kv_manager, killed)
