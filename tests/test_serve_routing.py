"""Prefix-affine routing (``serve_app/routing.py``): the disaggregated app with two prefill replicas and two ingress
replicas, each ingress with its own router. A repeated prompt, and the next turns of a conversation, reach the
prefill replica that holds its pages, whichever ingress takes them; the rendezvous ranking spreads prompts over the
replicas and moves only a departed replica's prompts."""

import hashlib
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
    with tiny_service(tmp_path_factory.mktemp("routing_pair"), prefill={"num_replicas": 2, "max_ongoing_requests": 2},
                      ingress={"num_replicas": 2}) as url:
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
