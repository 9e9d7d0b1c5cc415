"""The OpenAI-compatible service on a local Ray cluster: the disaggregated application over the tiny pair."""

import json
import re
import time

import httpx
import pytest

pytestmark = pytest.mark.ray

import openai  # noqa: E402
import ray  # noqa: E402
from ray import serve  # noqa: E402

from engine.sequence import SamplingParams  # noqa: E402
from serve_app.app import build_app  # noqa: E402
from serve_app.metrics import HANDOFF_PHASES  # noqa: E402
from tests.test_serve_support import (CHUNK, free_port, metric_samples, metric_sum, service_args, wait_healthy,  # noqa: E402
                                      write_tiny_pair)

PROMPTS = ["Hello world", "The quick brown fox", "abc"]
PAGE = 16          # the engine's default page size
PAGE_BYTES = 16 * 3 * 2 * 2 * 16 * 4      # 2 target layers + 1 draft layer, 2 KV heads x 16 dims, K and V, float32
MAX_CONCURRENT = 3


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    return write_tiny_pair(tmp_path_factory.mktemp("serve_pair"))


@pytest.fixture(scope="module")
def server(ray_cluster, tiny_pair):
    """The disaggregated app (1 prefill + 1 decode) on 127.0.0.1:<free port>."""
    target, drafter = tiny_pair
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(service_args(target, drafter, max_concurrent_requests=MAX_CONCURRENT)), name="dflash",
              route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url)
    yield url
    serve.shutdown()


@pytest.fixture(scope="module")
def offline(tiny_pair):
    from spec_decode import LLM

    target, drafter = tiny_pair
    return LLM(target, draft=drafter, num_pages=64, max_num_batched_tokens=CHUNK)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)


def metrics(url: str) -> dict:
    return metric_samples(httpx.get(f"{url}/metrics", timeout=30).text)


def wait_pages_free(url: str, timeout_s: float = 10.0) -> float:
    deadline = time.monotonic() + timeout_s
    while True:
        in_use = metric_sum(metrics(url), "dflash_kv_pages_in_use")
        if in_use == 0 or time.monotonic() > deadline:
            return in_use
        time.sleep(0.2)


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param
    return body["error"]


def assert_healthy_and_free(url: str) -> None:
    r = httpx.get(f"{url}/health", timeout=10)
    assert (r.status_code, r.json()) == (200, {"status": "ok"})
    assert wait_pages_free(url) == 0


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_greedy_completions_equal_the_offline_engine(client, offline):
    expected = [o.text for o in offline.generate(PROMPTS, SamplingParams(max_tokens=20, ignore_eos=True))]
    got = []
    for prompt in PROMPTS:
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 20
        spec = r.usage.model_extra["spec_decode"]
        assert spec["num_drafts"] > 0 and spec["draft_tokens"] == 3 * spec["num_drafts"]
        got.append(r.choices[0].text)
    assert got == expected
    streamed = []
    for prompt in PROMPTS:
        chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True}))
        assert chunks[-1].choices[0].finish_reason == "length"
        streamed.append("".join(c.choices[0].text for c in chunks))
    assert streamed == expected


def test_greedy_chat_equals_the_offline_engine_on_the_chat_template(client, offline):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    rendered = "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"
    expected = offline.generate([rendered], SamplingParams(max_tokens=12, ignore_eos=True))[0].text
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == expected
    assert r.usage.prompt_tokens == len(offline.tokenizer.encode(rendered))
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_cut_the_text_as_offline_and_the_early_first_token_agrees(client, offline, stream):
    """The first token is streamed from the prefill side while the KV moves; with a stop string that could
    begin in it, what it sends is only text the decode side's output confirms."""
    prompt = "The quick brown fox"
    full = offline.generate([prompt], SamplingParams(max_tokens=20, ignore_eos=True))[0].text
    for stop in (full[:2], full[3:5], full[-3:]):
        expected = offline.generate([prompt], SamplingParams(max_tokens=20, ignore_eos=True, stop=(stop,)))[0]
        assert expected.finish_reason == "stop" and stop not in expected.text
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0, stop=[stop],
                                      stream=stream, extra_body={"ignore_eos": True})
        if stream:
            chunks = list(r)
            text, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            text, reason = r.choices[0].text, r.choices[0].finish_reason
        assert (text, reason) == (expected.text, "stop")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_puts_each_choices_tokens_so_far_on_its_chunks(server, path):
    """vLLM's ``stream_options.continuous_usage_stats``: every choice chunk carries that choice's usage so far
    (its prompt, the tokens sent up to and with this chunk), the last chunk the whole usage; without it only the
    last chunk has usage, and without include_usage none does."""
    prompt = {"messages": [{"role": "user", "content": "count"}]} if "chat" in path else {"prompt": [5, 6, 7]}
    body = {"model": "tiny", **prompt, "max_tokens": 7, "n": 2, "temperature": 1.0, "seed": 3, "stream": True,
            "ignore_eos": True, "return_token_ids": True}

    def events(stream_options):
        r = httpx.post(f"{server}{path}", json={**body, "stream_options": stream_options}, timeout=60)
        assert r.status_code == 200, r.text
        return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]

    got = events({"include_usage": True, "continuous_usage_stats": True})
    final = got[-1]["usage"]
    assert got[-1]["choices"] == [] and final["completion_tokens"] == 14 and "spec_decode" in final
    sent, counted = {0: 0, 1: 0}, {0: [], 1: []}
    for event in got[:-1]:
        (choice,) = event["choices"]
        sent[choice["index"]] += len(choice["token_ids"])
        usage = event["usage"]
        assert set(usage) == {"prompt_tokens", "completion_tokens", "total_tokens"}, usage
        # (a token whose text is not whole yet is counted before its chunk goes out)
        assert usage["completion_tokens"] >= sent[choice["index"]], (event, sent)
        assert usage["prompt_tokens"] == final["prompt_tokens"]       # (one prompt, counted once)
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        counted[choice["index"]].append(usage["completion_tokens"])
    assert sent == {0: 7, 1: 7}
    assert all(c == sorted(c) and c[-1] == 7 and len(set(c)) > 1 for c in counted.values()), counted
    plain = events({"include_usage": True})
    assert all(e["usage"] is None for e in plain[:-1]) and plain[-1]["usage"]["completion_tokens"] == 14
    assert all("usage" not in e for e in events({"include_usage": False, "continuous_usage_stats": True}))


def test_sse_stream_ends_with_done_and_token_id_prompts_work(server):
    body = {"model": "tiny", "prompt": [5, 6, 7, 8, 9], "max_tokens": 5, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_n_choices_and_seeded_sampling(client):
    r = client.completions.create(model="tiny", prompt="abc", max_tokens=8, temperature=1.0, seed=7, n=2,
                                  extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1] and r.usage.completion_tokens == 16
    again = client.completions.create(model="tiny", prompt="abc", max_tokens=8, temperature=1.0, seed=7, n=2,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in r.choices]


@pytest.mark.parametrize("body,status,param", [
    ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "hi", "n": 0}, 400, "n"),
    ({"prompt": "x" * 600}, 400, "prompt"),                       # over the 512-token context
    ({"prompt": [1, 2, 999]}, 400, "prompt"),                      # outside the vocabulary
    ({"prompt": "hi", "model": "no-such-model"}, 404, "model"),
    ({"max_tokens": 4}, 400, "prompt"),                            # missing field
    ({"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),   # wrong type
])
def test_errors_have_the_openai_shape_and_leave_the_server_healthy(server, body, status, param):
    r = httpx.post(f"{server}/v1/completions", json={"model": "tiny", **body}, timeout=60)
    error = assert_error(r, status, param)
    if status == 400 and param == "prompt" and "x" in str(body.get("prompt")):
        assert error["code"] == "context_length_exceeded"
    assert_healthy_and_free(server)


def long_prompt(n: int, seed: int) -> list[int]:
    return [4 + (seed * 31 + 7 * j + j * j) % 95 for j in range(n)]


def greedy_ids(client, prompt_ids: list[int], max_tokens: int) -> list[int]:
    r = client.completions.create(model="tiny", prompt=prompt_ids, max_tokens=max_tokens, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == max_tokens
    return r.choices[0].model_extra["token_ids"]


@pytest.mark.parametrize("length", [1, CHUNK, 3 * CHUNK - 5, 512 - 8], ids=["one-token", "one-chunk",
                                                                              "three-chunks", "context-limit"])
def test_prompts_of_any_length_are_prefilled_whole(client, offline, server, length):
    """The prefill replica hands a request over only once every chunk of its prompt is computed."""
    prompt = long_prompt(length, seed=length)
    expected = offline.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    assert greedy_ids(client, prompt, 8) == expected
    assert_healthy_and_free(server)


@pytest.mark.parametrize("length", [CHUNK - 5, 2 * CHUNK, 3 * CHUNK + 9], ids=["one-chunk", "two-chunks",
                                                                            "three-chunks-and-a-part"])
def test_a_repeated_prompt_is_prefilled_from_its_cached_pages(client, offline, server, length):
    """The prefill replica's request ends in the step that computes the last of its prompt: the pages of that step
    (all of a one-chunk prompt's) are cached too, drafter context included, so a repeated prompt is computed from
    them (every full page but the one holding its last token, which is always computed)."""
    prompt = long_prompt(length, seed=77 + length)
    expected = offline.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
    before = metrics(server)
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
    after = metrics(server)

    def delta(name):
        return metric_sum(after, name) - metric_sum(before, name)

    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == (length - 1) // PAGE * PAGE
    assert delta("dflash_prefix_cache_hit_tokens_total") == (length - 1) // PAGE * PAGE
    # The decode side holds those pages too (the first request's): it READs only the page of the last token.
    assert delta("dflash_kv_transfer_reused_pages_total") == (length - 1) // PAGE
    assert delta("dflash_kv_transfer_bytes_total") == (-(-length // PAGE) - (length - 1) // PAGE) * PAGE_BYTES
    assert [r.choices[0].model_extra["token_ids"] for r in (first, again)] == [expected, expected]
    assert_healthy_and_free(server)


def test_concurrent_long_prompts_each_equal_their_offline_output(client, offline, server):
    from concurrent.futures import ThreadPoolExecutor

    prompts = [long_prompt(4 * CHUNK + 17 * i, seed=100 + i) for i in range(MAX_CONCURRENT)]
    expected = [o.token_ids for o in offline.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))]
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: greedy_ids(client, p, 12), prompts))
    assert got == expected
    assert_healthy_and_free(server)


def test_concurrent_turns_of_one_conversation_share_its_cached_pages_on_both_sides(client, offline, server):
    """A conversation's first turn, then its next turns (the first turn's prompt, its answer, more) at once: each
    takes the common pages from the prefill side's cache and from the decode side's (shared by the concurrent
    READs, which skip them), each output equals offline, and every page comes back."""
    from concurrent.futures import ThreadPoolExecutor

    first_prompt = long_prompt(2 * CHUNK + 12, seed=500)
    answer = greedy_ids(client, first_prompt, 12)
    turns = [first_prompt + answer + long_prompt(5 + 9 * i, seed=600 + i) for i in range(MAX_CONCURRENT)]
    expected = [o.token_ids for o in offline.generate(turns, SamplingParams(max_tokens=8, ignore_eos=True))]
    before = metrics(server)
    with ThreadPoolExecutor(len(turns)) as pool:
        got = list(pool.map(lambda p: client.completions.create(
            model="tiny", prompt=p, max_tokens=8, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True}), turns))
    after = metrics(server)
    assert [r.choices[0].model_extra["token_ids"] for r in got] == expected
    # 140 prompt tokens and 12 answer tokens: 9 full pages in common. The prefill side holds the first prompt's 8
    # (and the 9th once the first of the three to be computed has computed it); the decode side holds those 8 (READ
    # for the first turn) and the 9th, which it filled decoding the answer (reusable once the drafter context of its
    # tokens was stored, which the last steps' acceptance decides): each of the three READs skips 8 or 9.
    common = (len(first_prompt) + len(answer)) // PAGE
    assert (common, len(first_prompt) // PAGE) == (9, 8)
    assert all(8 * PAGE <= r.usage.prompt_tokens_details.cached_tokens <= 9 * PAGE for r in got)
    reused = metric_sum(after, "dflash_kv_transfer_reused_pages_total") - \
        metric_sum(before, "dflash_kv_transfer_reused_pages_total")
    assert MAX_CONCURRENT * 8 <= reused <= MAX_CONCURRENT * common
    assert_healthy_and_free(server)


def test_chat_schema_violation_is_a_400_as_openai_answers_it(server):
    r = httpx.post(f"{server}/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "robot",
                                                                                          "content": "x"}]})
    assert assert_error(r, 400)["code"] == "schema_violation"
    r = httpx.post(f"{server}/v1/chat/completions", json={"model": "tiny", "messages": []})
    assert assert_error(r, 400, "messages")["code"] == "schema_violation"


def test_overload_is_429_with_retry_after_and_the_admitted_requests_finish(server):
    from concurrent.futures import ThreadPoolExecutor

    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 300, "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(2 * MAX_CONCURRENT) as pool:
        codes = list(pool.map(lambda _: httpx.post(f"{server}/v1/completions", json=body, timeout=120),
                              range(2 * MAX_CONCURRENT)))
    assert sorted(r.status_code for r in codes).count(200) >= 1
    overloaded = [r for r in codes if r.status_code == 429]
    assert overloaded, [r.status_code for r in codes]
    assert assert_error(overloaded[0], 429)["code"] == "overloaded" and overloaded[0].headers["retry-after"] == "1"
    assert {r.status_code for r in codes} <= {200, 429}
    assert_healthy_and_free(server)


def test_disconnect_mid_stream_aborts_and_frees_pages(server):
    aborted = metric_sum(metrics(server), "dflash_request_success_total", finished_reason="abort")
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 350, "temperature": 0, "stream": True,
            "ignore_eos": True}
    for _ in range(2):
        with httpx.Client(timeout=60) as c:
            s = c.send(c.build_request("POST", f"{server}/v1/completions", json=body), stream=True)
            assert s.status_code == 200
            assert next(line for line in s.iter_lines() if line.startswith("data: "))     # streaming has begun
            s.close()
    deadline = time.monotonic() + 10
    while metric_sum(metrics(server), "dflash_request_success_total", finished_reason="abort") < aborted + 2:
        assert time.monotonic() < deadline, "the disconnected streams were not aborted"
        time.sleep(0.2)
    assert_healthy_and_free(server)


def test_a_request_that_ends_at_its_first_token_ends_the_decode_stand_by(server, client):
    """The decode replica is called as the prefill starts, and reserves pages for the prompt. A request whose first
    token ends it (max_tokens 1, streamed or not) holds no prefill pages for a READ, and the decode side stops
    standing by and frees its reservation at once (not at its ticket timeout): the router ends the stand-by itself,
    as it does for a client that goes away before the first token."""
    leases, stand_bys = prefill_lease_counts(), decode_stand_bys()
    prompt = [(13 * i) % 90 + 5 for i in range(3 * CHUNK)]
    assert client.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0).usage.completion_tokens == 1
    assert len(list(client.completions.create(model="tiny", prompt=prompt, max_tokens=1, stream=True))) >= 1
    deadline = time.monotonic() + 10
    while decode_stand_bys() < stand_bys + 2:
        assert time.monotonic() < deadline, "the decode side never stood by for the requests"
        time.sleep(0.1)
    assert_healthy_and_free(server)
    assert prefill_lease_counts() == leases


def decode_stand_bys() -> int:
    """Decode take-overs ever begun by the decode replicas' engine processes."""
    from actors.worker import KV_MANAGER_NAMESPACE

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == KV_MANAGER_NAMESPACE and a["name"].startswith("decode-")
             and a["name"].endswith("-rank0-worker")]
    assert names
    return sum(g["stand_bys"] for g in ray.get([ray.get_actor(n, namespace=KV_MANAGER_NAMESPACE).gauges.remote()
                                                 for n in names]))


def prefill_lease_counts() -> dict:
    """The lease counts (``KVManagerActor.hold_stats``) of every prefill rank 0's KV manager, summed."""
    from actors.worker import KV_MANAGER_NAMESPACE

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == KV_MANAGER_NAMESPACE and a["name"].startswith("prefill-")
             and a["name"].endswith("-rank0")]
    assert names
    stats = ray.get([ray.get_actor(n, namespace=KV_MANAGER_NAMESPACE).hold_stats.remote() for n in names])
    return {k: sum(s[k] for s in stats) for k in stats[0]}


def test_a_finished_request_cancels_nothing(server, client):
    """A request that ended, streamed or not, sends no cancel for its decode call or its prefill lease, which its
    READ ended already: the ingress drops its stream after the last chunk, which must not count as a disconnect
    (``test_disconnect_mid_stream_aborts_and_frees_pages`` checks one that does)."""
    before = prefill_lease_counts()
    client.completions.create(model="tiny", prompt="Hello", max_tokens=8, temperature=0)
    for _ in client.completions.create(model="tiny", prompt="Hello", max_tokens=8, temperature=0, stream=True):
        pass
    time.sleep(1.0)       # a late cancel goes out as the ingress collects the request's stream
    after = prefill_lease_counts()
    assert after["read"] == before["read"] + 2
    assert after["after_release"] == before["after_release"], "a finished request sent a cancel"
    assert after["cancelled"] == before["cancelled"]


def test_metrics_parse_and_counters_move_by_the_request(server, client):
    before = metrics(server)
    r = client.completions.create(model="tiny", prompt=[3, 4, 5, 6, 7, 8, 9], max_tokens=10, temperature=0,
                                  extra_body={"ignore_eos": True})
    after = metrics(server)

    def delta(name, **labels):
        return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)

    spec = r.usage.model_extra["spec_decode"]
    assert delta("dflash_prompt_tokens_total") == 7
    assert delta("dflash_generation_tokens_total") == 10
    assert delta("dflash_request_success_total", finished_reason="length") == 1
    # The prefill engine's process sent its result (the ticket) and the decode engine's process the token chunks (one
    # per step at most, of 10 tokens: its first output repeats the prefill's token) straight to the ingress; none
    # came through a replica's Serve stream.
    assert 2 <= delta("dflash_stream_chunks_total", path="sink") <= 11
    assert delta("dflash_stream_chunks_total", path="replica") == 0
    assert delta("dflash_time_to_first_token_seconds_count") == 1
    assert delta("dflash_e2e_request_latency_seconds_count") == 1
    # Host-memory pools: NIXL moves the pages (a mapped copy is only for pools on one GPU).
    assert delta("dflash_kv_transfers_total", transport="nixl") == 1 and delta("dflash_kv_transfers_total") == 1
    assert delta("dflash_kv_transfer_bytes_total") == PAGE_BYTES       # 7 prompt tokens: one page
    assert delta("dflash_kv_transfer_descriptors_total") == 1       # one page, one pool group (all float32)
    # The hand-off as the ingress saw it, and inside it the decode engine process's phases, the READ inside theirs.
    assert delta("dflash_kv_handoff_seconds_count") == 1
    phases = {}
    for phase in HANDOFF_PHASES:
        assert delta("dflash_kv_handoff_phase_seconds_count", phase=phase) == 1, phase
        phases[phase] = delta("dflash_kv_handoff_phase_seconds_sum", phase=phase)
    assert 0 < sum(phases.values()) < delta("dflash_kv_handoff_seconds_sum")
    assert phases["read"] > delta("dflash_kv_transfer_latency_seconds_sum") > 0
    assert delta("dflash_spec_decode_num_drafts_total") == spec["num_drafts"] > 0
    assert delta("dflash_spec_decode_num_draft_tokens_total") == spec["draft_tokens"]
    accepted = delta("dflash_spec_decode_num_accepted_tokens_total")
    assert accepted == spec["accepted_tokens"]
    assert sum(delta("dflash_spec_decode_num_accepted_tokens_per_pos_total", position=str(k))
               for k in range(3)) == accepted
    assert 1 + accepted / spec["num_drafts"] == pytest.approx(spec["mean_acceptance_length"])
    roles = {dict(labels)["role"] for (name, labels) in after if name == "dflash_num_replicas"}
    assert roles == {"prefill", "decode"}


def test_health_and_requests_are_503_until_replicas_are_ready(server, tiny_pair):
    """An app whose engine replica cannot be placed (it asks for a GPU): the ingress is up, no engine is."""
    target, drafter = tiny_pair
    args = service_args(target, drafter, mode="aggregated", aggregated={"num_gpus": 1})
    serve._run(build_app(args), _blocking=False, name="cold", route_prefix="/cold")
    try:
        deadline = time.monotonic() + 120
        while True:     # the proxy answers 404 until the cold app's ingress is up
            try:
                r = httpx.get(f"{server}/cold/health", timeout=10)
                if r.status_code == 503 or time.monotonic() > deadline:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        assert_error(r, 503)
        assert_error(httpx.post(f"{server}/cold/v1/completions", json={"model": "tiny", "prompt": "hi"},
                                timeout=30), 503)
    finally:
        serve.delete("cold")


# --- hostile input, limits and access ------------------------------------------------------------------------
INTERNALS = re.compile(r"pid=|\b\d+\.\d+\.\d+\.\d+\b|[0-9a-f]{24,}|\x1b\[|Traceback|Error:|prefill-|decode-")


@pytest.mark.parametrize("method,path,content,status", [
    ("GET", "/v1/nothing", None, 404),
    ("GET", "/v1/completions", None, 405),
    ("DELETE", "/health", None, 405),
    ("POST", "/v1/completions", b"{not json", 400),
    ("GET", "/docs", None, 404),                      # off unless the config enables them
    ("GET", "/openapi.json", None, 404),
])
def test_paths_methods_and_unparsable_bodies_get_openai_shaped_errors(server, method, path, content, status):
    r = httpx.request(method, f"{server}{path}", content=content, headers={"content-type": "application/json"},
                      timeout=30)
    assert_error(r, status)


@pytest.mark.parametrize("path,raw,param", [
    ("/v1/completions", '{"model": "tiny", "prompt": "a\\ud800b"}', "prompt"),
    ("/v1/completions", '{"model": "tiny", "prompt": ["ok", "\\udfff"]}', "prompt"),
    ("/v1/completions", '{"model": "tiny", "prompt": "ab", "stop": ["\\ud800"]}', "stop"),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}',
     "messages.0.content"),
    ("/v1/completions", '{"model": "tiny", "prompt": "ab", "seed": 18446744073709551616}', "seed"),
    ("/v1/completions", '{"model": "tiny", "prompt": "ab", "temperature": NaN}', "temperature"),
    ("/v1/completions", '{"model": "tiny", "prompt": [1, 2, 99999999999999999999]}', "prompt"),
])
def test_bad_unicode_and_out_of_range_numbers_are_400s_naming_the_field(server, path, raw, param):
    r = httpx.post(f"{server}{path}", content=raw.encode(), headers={"content-type": "application/json"}, timeout=30)
    assert not INTERNALS.search(assert_error(r, 400, param)["message"])
    assert_healthy_and_free(server)


def test_a_body_over_the_limit_is_413_whether_its_length_is_declared_or_chunked(server):
    body = json.dumps({"model": "tiny", "prompt": "a" * (1 << 20)}).encode()
    assert assert_error(httpx.post(f"{server}/v1/completions", content=body,
                                   headers={"content-type": "application/json"}, timeout=30), 413)["code"] \
        == "request_too_large"
    chunked = httpx.post(f"{server}/v1/completions", content=iter([body[i:i + 65536]
                                                                    for i in range(0, len(body), 65536)]),
                         headers={"content-type": "application/json"}, timeout=30)
    assert "content-length" not in chunked.request.headers
    assert_error(chunked, 413)


def test_a_huge_prompt_is_tokenized_off_the_event_loop(server):
    """A prompt just under the 1 MiB body limit takes seconds to tokenize: meanwhile the same ingress keeps
    answering /v1/models (which tokenizing on the event loop would stall for those seconds)."""
    import threading

    body = {"model": "tiny", "prompt": "a" * 1_040_000}
    result = {}

    def huge():
        result["response"] = httpx.post(f"{server}/v1/completions", json=body, timeout=120)

    latencies = []
    with httpx.Client(timeout=30) as c:
        c.get(f"{server}/v1/models")
        t = threading.Thread(target=huge)
        t.start()
        while t.is_alive():
            start = time.perf_counter()
            assert c.get(f"{server}/v1/models").status_code == 200
            latencies.append(time.perf_counter() - start)
        t.join()
    assert assert_error(result["response"], 400, "prompt")["code"] == "context_length_exceeded"
    latencies.sort()
    assert len(latencies) >= 5, latencies              # the huge request really was in flight a while
    assert latencies[len(latencies) // 2] < 0.1 and latencies[-1] < 0.5, latencies


def test_admission_counts_choices_not_requests(server):
    from concurrent.futures import ThreadPoolExecutor

    too_many = {"model": "tiny", "prompt": ["a", "b"], "n": 2, "max_tokens": 2}         # 4 choices > 3
    assert_error(httpx.post(f"{server}/v1/completions", json=too_many, timeout=30), 400, "n")
    body = {"model": "tiny", "prompt": "Hello", "n": 2, "max_tokens": 300, "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(2) as pool:       # 2 + 2 choices: one of the two requests is over the limit of 3
        codes = sorted(r.status_code for r in pool.map(
            lambda _: httpx.post(f"{server}/v1/completions", json=body, timeout=120), range(2)))
    assert codes == [200, 429]
    assert_healthy_and_free(server)


def body_strategy():
    """(path, body): a valid body with up to two fields replaced by hostile values (wrong types, NaN and
    infinities, huge and negative numbers, lone surrogates, junk), plus unknown extra fields."""
    from hypothesis import strategies as st

    junk = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8),
                     st.lists(st.integers(-3, 200), max_size=4),
                     st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))
    text = st.one_of(st.text(min_size=1, max_size=12), st.sampled_from(["\ud800", "a\udfffb", "", "\x00", "\u202e"]))
    big = st.sampled_from([2 ** 31, 2 ** 63, 2 ** 64, -2 ** 63 - 1, 10 ** 30])
    number = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-3, 3), st.just(1e308))
    valid = {
        "model": st.just("tiny"), "max_tokens": st.integers(1, 6), "temperature": st.floats(0, 2),
        "top_p": st.floats(0.05, 1), "top_k": st.integers(-1, 50), "n": st.integers(1, 3),
        "seed": st.integers(-2 ** 63, 2 ** 63 - 1), "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2),
        "stream": st.booleans(), "ignore_eos": st.booleans(),
    }
    hostile = {
        "model": st.one_of(text, junk), "max_tokens": st.one_of(st.integers(-2, 0), big, junk),
        "temperature": st.one_of(number, junk), "top_p": st.one_of(number, junk),
        "top_k": st.one_of(st.integers(-5, -2), big, junk), "n": st.one_of(st.integers(-1, 0), st.just(10 ** 6), junk),
        "seed": st.one_of(big, junk), "stop": st.one_of(text, st.lists(text, max_size=6), junk),
        "stream": junk, "ignore_eos": junk, "stream_options": st.one_of(st.fixed_dictionaries(
            {"include_usage": st.booleans()}, optional={"continuous_usage_stats": st.one_of(st.booleans(), junk)}),
            junk),
        "logprobs": st.one_of(st.integers(-2, 25), st.booleans(), junk), "top_logprobs": st.one_of(st.integers(-2, 25), junk),
        "echo": st.one_of(st.booleans(), junk), "best_of": st.one_of(st.integers(-1, 3), junk),
        "logit_bias": st.one_of(st.dictionaries(st.one_of(st.text(max_size=4), st.integers(-5, 200).map(str)),
                                                number, max_size=3), junk),
        "presence_penalty": st.one_of(number, junk), "repetition_penalty": st.one_of(number, junk),
        "min_tokens": st.one_of(st.integers(-2, 8), big, junk),
        "stop_token_ids": st.one_of(st.lists(st.integers(-2, 200), max_size=3), junk),
        "include_stop_str_in_output": junk, "response_format": st.one_of(st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "json_object"])}), junk), "tools": junk,
        "add_generation_prompt": st.one_of(st.booleans(), junk),
        "continue_final_message": st.one_of(st.booleans(), junk),
        "chat_template_kwargs": st.one_of(st.dictionaries(st.sampled_from(["messages", "x", "eos_token"]), junk,
                                                          max_size=2), junk),
    }
    prompt = st.one_of(st.text(min_size=1, max_size=12), st.lists(st.integers(4, 99), min_size=1, max_size=6),
                       st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=2))
    bad_prompt = st.one_of(text, st.lists(st.integers(-5, 120), max_size=6), st.lists(text, max_size=3),
                           st.lists(st.lists(st.integers(0, 99), max_size=4), max_size=2), big, junk)
    message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                     "content": st.text(min_size=1, max_size=12)})
    bad_message = st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "robot"]), junk),
                                         "content": st.one_of(text, junk)})

    @st.composite
    def case(draw):
        chat = draw(st.booleans())
        body = {name: draw(strategy) for name, strategy in valid.items() if draw(st.booleans())}
        body["model"] = "tiny"
        if chat:
            body["messages"] = draw(st.lists(message, min_size=1, max_size=3))
            body.setdefault("max_tokens", 4)
        else:
            body["prompt"] = draw(prompt)
        for name in draw(st.lists(st.sampled_from([*hostile, "payload", "extra"]), max_size=2, unique=True)):
            if name == "payload":
                body["messages" if chat else "prompt"] = draw(st.one_of(st.lists(bad_message, max_size=3), junk)
                                                             if chat else bad_prompt)
            elif name == "extra":
                body[draw(st.text(min_size=1, max_size=8))] = draw(junk)
            else:
                body[name] = draw(hostile[name])
        return ("/v1/chat/completions" if chat else "/v1/completions"), body

    return case()


def test_fuzzed_requests_never_get_a_5xx_and_every_error_has_the_openai_shape(server):
    """Random bodies around the schema (wrong types, NaN, huge and negative numbers, lone surrogates, junk
    fields): each answer is a 2xx or a 4xx with OpenAI's error shape naming nothing internal; pages return."""
    from hypothesis import HealthCheck, given, settings

    seen: set[int] = set()

    @settings(max_examples=120, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(body_strategy())
    def check(case):
        path, body = case
        r = httpx.post(f"{server}{path}", content=json.dumps(body).encode(),
                       headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code < 500, (body, r.text)
        seen.add(r.status_code)
        if r.status_code >= 400:
            error = assert_error(r, r.status_code)
            assert not INTERNALS.search(error["message"]), error
            seen.add("schema" if error["code"] == "schema_violation" else "value")
        elif r.headers["content-type"].startswith("text/event-stream"):
            events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and not any(e.startswith('{"error"') for e in events), r.text

    check()
    # the strategy reaches accepted bodies, and refused ones both by the schema and by the value checks
    assert {200, 400, "schema", "value"} <= seen, seen
    assert_healthy_and_free(server)


def test_api_key_guards_v1_and_docs_turn_on_only_when_asked(server, tiny_pair, monkeypatch):
    """An app whose engine cannot be placed (it asks for a GPU): the ingress alone answers, behind a key."""
    from serve_app.config import parse_service_config
    from serve_app.ingress import api_key

    target, drafter = tiny_pair
    args = service_args(target, drafter, mode="aggregated", aggregated={"num_gpus": 1},
                        api_key="sesame", enable_docs=True)
    serve._run(build_app(args), _blocking=False, name="locked", route_prefix="/locked")
    try:
        url = f"{server}/locked"
        deadline = time.monotonic() + 120
        while True:       # the proxy answers 404 (or holds the request) until the app's ingress is up
            try:
                if httpx.get(f"{url}/health", timeout=10).status_code != 404:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the locked app's ingress never came up"
            time.sleep(0.3)
        body = {"model": "tiny", "prompt": "hi"}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
            error = assert_error(httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=30), 401)
            assert error["code"] == "invalid_api_key" and "sesame" not in error["message"]
        assert_error(httpx.get(f"{url}/v1/models", timeout=30), 401)
        keyed = {"Authorization": "Bearer sesame"}
        assert httpx.get(f"{url}/v1/models", headers=keyed, timeout=30).status_code == 200
        # Past the key: the request reaches admission (no engine replica is up: 503).
        assert_error(httpx.post(f"{url}/v1/completions", json=body, headers=keyed, timeout=30), 503)
        assert_error(httpx.get(f"{url}/health", timeout=30), 503)          # /health needs no key
        assert "/v1/completions" in httpx.get(f"{url}/openapi.json", timeout=30).json()["paths"]
        assert httpx.get(f"{url}/docs", timeout=30).status_code == 200
    finally:
        serve.delete("locked")
    assert httpx.get(f"{server}/v1/models", timeout=30).status_code == 200       # the main app stays open
    monkeypatch.setenv("DFLASH_API_KEY", "from-env")
    assert api_key(parse_service_config({})) == "from-env"
    assert api_key(parse_service_config({"api_key": "from-config"})) == "from-config"
    monkeypatch.delenv("DFLASH_API_KEY")
    assert api_key(parse_service_config({})) is None



# --- OpenAI sampling parameters: against the target-only engine -------------------------------------------
@pytest.fixture(scope="module")
def target_only(tiny_pair):
    from engine import LLM

    return LLM(tiny_pair[0], num_pages=64, max_num_batched_tokens=CHUNK)


def completion(server, **body) -> dict:
    r = httpx.post(f"{server}/v1/completions", json={"model": "tiny", "temperature": 0, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def stream_completion(server, **body) -> list[dict]:
    with httpx.stream("POST", f"{server}/v1/completions", json={"model": "tiny", "temperature": 0, "stream": True,
                                                                 **body}, timeout=60) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_completion_logprobs_equal_target_only_decoding_also_streamed(server, target_only):
    """The drafter proposes, the target's verification forward gives the numbers: the same as target-only."""
    prompt = "The quick brown fox"
    ref = target_only.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True, logprobs=3))[0]
    body = completion(server, prompt=prompt, max_tokens=12, ignore_eos=True, logprobs=3, return_token_ids=True)
    choice = body["choices"][0]
    assert body["usage"]["spec_decode"]["num_drafts"] > 0 and choice["token_ids"] == ref.token_ids
    lp = choice["logprobs"]
    assert lp["token_logprobs"] == pytest.approx([e.logprob for e in ref.logprobs], abs=1e-5)
    assert len(lp["tokens"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 12
    assert "".join(lp["tokens"]) == choice["text"] and lp["text_offset"][0] == 0
    text = target_only.tokenizer.token_text
    for top, entry in zip(lp["top_logprobs"], ref.logprobs):
        # Keyed by token text as OpenAI does: ids with the same text (ids past the tokenizer's) share a key.
        assert set(top) == {text(t) for t, _ in entry.top} and len(entry.top) == 3
        for token, value in top.items():
            assert value == pytest.approx(max(v for t, v in entry.top if text(t) == token), abs=1e-5)
    events = stream_completion(server, prompt=prompt, max_tokens=12, ignore_eos=True, logprobs=3)
    streamed = [v for e in events for c in e["choices"] if c["logprobs"] for v in c["logprobs"]["token_logprobs"]]
    # Within the reference's tolerance: between these two requests one run saw logprobs move by 2e-6 (float32).
    assert streamed == pytest.approx(lp["token_logprobs"], abs=1e-5)


def test_chat_logprobs_and_top_logprobs(server, target_only):
    rendered = "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"
    ref = target_only.generate([rendered], SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2))[0]
    r = httpx.post(f"{server}/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 6, "temperature": 0,
        "ignore_eos": True, "logprobs": True, "top_logprobs": 2}, timeout=60)
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [c["logprob"] for c in content] == pytest.approx([e.logprob for e in ref.logprobs], abs=1e-5)
    assert all(len(c["top_logprobs"]) == 2 and c["bytes"] == list(c["token"].encode()) for c in content)
    assert "".join(c["token"] for c in content) == r.json()["choices"][0]["message"]["content"]
    plain = httpx.post(f"{server}/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, timeout=60)
    assert plain.json()["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("options", [
    {"presence_penalty": 1.5}, {"frequency_penalty": 0.8}, {"repetition_penalty": 1.6},
    {"logit_bias": {"40": 100}}, {"logit_bias": {"40": 6.5, "41": -100}, "frequency_penalty": -0.5},
], ids=["presence", "frequency", "repetition", "bias", "bias+negative-frequency"])
def test_penalties_and_bias_give_the_target_only_output(server, target_only, options):
    prompt = "abcabcabc"
    params = {k: v for k, v in options.items() if k != "logit_bias"}
    bias = {int(k): v for k, v in options.get("logit_bias", {}).items()}
    ref = target_only.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True, logit_bias=bias, **params))[0]
    plain = target_only.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True))[0]
    assert ref.token_ids != plain.token_ids            # the option matters on this prompt
    body = completion(server, prompt=prompt, max_tokens=16, ignore_eos=True, return_token_ids=True, **options)
    assert body["choices"][0]["token_ids"] == ref.token_ids and body["choices"][0]["text"] == ref.text


def test_stop_token_ids_min_tokens_and_include_stop_str(server, target_only):
    prompt = "Hello world"
    free = target_only.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    stop_id = free.token_ids[2]
    j = free.token_ids.index(stop_id)
    body = completion(server, prompt=prompt, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_id],
                      return_token_ids=True)
    assert body["choices"][0]["finish_reason"] == "stop" and body["choices"][0]["token_ids"] == free.token_ids[:j + 1]
    ref = target_only.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=(stop_id,),
                                                        min_tokens=j + 1))[0]
    assert len(ref.token_ids) > j + 1
    body = completion(server, prompt=prompt, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_id],
                      min_tokens=j + 1, return_token_ids=True)
    assert body["choices"][0]["token_ids"] == ref.token_ids
    stop = free.text[4:6]
    for include in (False, True):
        body = completion(server, prompt=prompt, max_tokens=12, ignore_eos=True, stop=[stop],
                          include_stop_str_in_output=include)
        expected = free.text[:free.text.index(stop)] + (stop if include else "")
        assert (body["choices"][0]["text"], body["choices"][0]["finish_reason"]) == (expected, "stop")


def test_special_tokens_show_in_text_and_offsets_when_not_skipped(server):
    """vLLM's ``skip_special_tokens: false``: a forced ``<|im_end|>`` (id 2, special) is in the text, streamed and
    not (the disaggregated app's first token goes out from the prefill side), in logprobs' offsets, and in an
    echoed prompt of token ids; by default it is left out of all of them."""
    body = dict(prompt=[1, 40], max_tokens=4, ignore_eos=True, logit_bias={"2": 100})
    for skip, end in ((False, "<|im_end|>"), (True, "")):
        whole = completion(server, **body, logprobs=0, skip_special_tokens=skip)["choices"][0]
        assert whole["text"] == end * 4
        assert whole["logprobs"]["text_offset"] == [k * len(end) for k in range(4)]
        events = stream_completion(server, **body, skip_special_tokens=skip)
        assert "".join(c["text"] for e in events for c in e["choices"]) == end * 4
        echo = ("<|im_start|>" if not skip else "") + chr(40 - 5 + 32)     # printable characters from id 5
        assert completion(server, **body, echo=True, skip_special_tokens=skip)["choices"][0]["text"] == \
            echo + end * 4


def test_echo_prepends_the_prompt(server, target_only):
    free = target_only.generate(["Hello"], SamplingParams(max_tokens=5, ignore_eos=True))[0]
    body = completion(server, prompt="Hello", max_tokens=5, ignore_eos=True, echo=True)
    assert body["choices"][0]["text"] == "Hello" + free.text
    events = stream_completion(server, prompt=[44, 73, 80], max_tokens=5, ignore_eos=True, echo=True)
    assert "".join(c["text"] for e in events for c in e["choices"]).startswith(target_only.tokenizer.decode([44, 73, 80]))


@pytest.mark.parametrize("path,extra,param", [
    ("/v1/completions", {"best_of": 2}, "best_of"),
    ("/v1/completions", {"suffix": "end"}, "suffix"),
    ("/v1/completions", {"echo": True, "logprobs": 1}, "echo"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"logit_bias": {"x": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"99999": 1}}, "logit_bias"),
    ("/v1/completions", {"stop_token_ids": [99999]}, "stop_token_ids"),
    ("/v1/completions", {"presence_penalty": 3}, "presence_penalty"),
    ("/v1/completions", {"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
])
def test_unimplemented_or_bad_parameters_are_refused_by_name(server, path, extra, param):
    body = {"model": "tiny", "max_tokens": 2, **extra}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"})
    assert_error(httpx.post(f"{server}{path}", json=body, timeout=30), 400, param)


def test_unknown_fields_and_harmless_defaults_stay_accepted(server):
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "user": "u1", "some_vendor_field": {"x": 1},
            "best_of": 1, "suffix": None, "echo": False}
    assert httpx.post(f"{server}/v1/completions", json=body, timeout=30).status_code == 200
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "response_format": {"type": "text"}, "tool_choice": "none", "tools": [], "logprobs": False}
    assert httpx.post(f"{server}/v1/chat/completions", json=chat, timeout=30).status_code == 200


def test_the_bench_client_takes_acceptance_from_the_responses_usage(server):
    """``dflash-serve bench`` sums each streamed response's spec-decode usage: the same drafts and accepted tokens
    as the server's counters moved by (one ingress here, so its /metrics is current), whoever serves /metrics."""
    import argparse

    from serve_app.bench import _spec_counters, add_bench_args, bench

    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    args = parser.parse_args(["--url", server, "--num-requests", "4", "--max-concurrency", "2", "--input-len", "12",
                              "--output-len", "10", "--no-progress"])
    before = _spec_counters(server)
    summary = bench(args)
    after = _spec_counters(server)
    spec = summary["spec_decode"]
    assert summary["completed"] == 4 and spec["source"] == "usage" and spec["num_drafts"] > 0
    assert (spec["num_drafts"], spec["accepted_tokens"]) == (after[0] - before[0], after[1] - before[1])


@pytest.mark.parametrize("argv, message", [
    (["--url", "http://127.0.0.1:9"], "no OpenAI-compatible server answers at http://127.0.0.1:9"),
    (["--url", "127.0.0.1:8000"], "no OpenAI-compatible server answers at 127.0.0.1:8000"),
    (["--num-requests", "0"], "--num-requests"),
    (["--max-concurrency", "0"], "--max-concurrency must be >= 1"),
])
def test_the_bench_client_without_a_server_or_with_bad_numbers_exits_2_saying_why(argv, message, capsys):
    """Before any load: no server at the URL (nothing listens on port 9) or a count below 1 is one line and exit
    status 2, not a traceback."""
    from serve_app.cli import main

    assert main(["bench", "--no-progress", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err


def test_the_bench_clients_sse_reader_keeps_split_lines_whole():
    """The load client reads SSE from raw network reads: a line split across reads is parsed once whole, CRLF and
    LF both end lines, ``[DONE]`` and non-data lines are skipped, and what has no line end yet waits."""
    from serve_app.bench import _sse_data

    buffer = bytearray()
    reads = [b'data: {"a":', b' 1}\r\n\r\ndata: {"b": 2}\n', b"\n: keep-alive\n\ndata:{\"c\"", b": 3}\n\n",
             b"data: [DONE]\n\n", b'data: {"d": 4}']
    got = [bytes(p) for data in reads for p in _sse_data(buffer, data)]
    assert got == [b'{"a": 1}', b'{"b": 2}', b'{"c": 3}']
    assert bytes(buffer) == b'data: {"d": 4}'


def test_the_bench_client_splits_its_load_over_processes(server):
    """``--client-processes``: the requests and the concurrency are shared out (none lost, none twice), every
    process's requests complete, and the run reports one summary over all of them."""
    import argparse

    from serve_app.bench import _prompts, _shares, add_bench_args, bench

    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    args = parser.parse_args(["--url", server, "--num-requests", "5", "--max-concurrency", "3", "--input-len", "8",
                              "--output-len", "6", "--no-progress", "--client-processes", "2"])
    prompts = _prompts(args)
    shares = _shares(args, prompts)
    assert [a.max_concurrency for a, _ in shares] == [2, 1]
    assert sorted(map(tuple, (p for _, ps in shares for p in ps))) == sorted(map(tuple, prompts))
    summary = bench(args)
    assert summary["client_processes"] == 2 and summary["completed"] == 5, summary["errors"]
    assert summary["output_throughput"] * summary["duration_s"] == pytest.approx(5 * 6)


def test_metrics_split_each_request_into_engine_queue_prefill_and_decode(server):
    """Per finished request, the engines' queue, prefill and decode times (prefill side's queue and prefill when
    disaggregated): one observation each, inside the request's TTFT and end-to-end time as the ingress saw them."""
    names = ("queue", "prefill", "decode")
    series = [f"dflash_request_{n}_time_seconds" for n in names] + ["dflash_time_to_first_token_seconds",
                                                                    "dflash_e2e_request_latency_seconds"]

    def totals() -> dict[str, tuple[float, float]]:
        samples = metrics(server)
        return {s: (metric_sum(samples, f"{s}_count"), metric_sum(samples, f"{s}_sum")) for s in series}

    before = totals()
    body = {"model": "tiny", "prompt": "Hello world", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    for stream in (False, True):
        r = httpx.post(f"{server}/v1/completions", json={**body, "stream": stream}, timeout=60)
        assert r.status_code == 200
    after = totals()
    delta = {s: (after[s][0] - before[s][0], after[s][1] - before[s][1]) for s in series}
    assert all(count == 2 for count, _ in delta.values()), delta
    queue, prefill, decode, ttft, e2e = (total for _, total in delta.values())
    assert prefill > 0 and decode > 0 and queue >= 0
    assert queue + prefill <= ttft and queue + prefill + decode <= e2e, delta


def test_metrics_tell_where_each_engine_threads_time_goes(server):
    """/metrics carries each role's engine loop counters as its replicas report them: a request's prompt step on
    the prefill side and decode steps on the decode side, each with its wall and CPU time, and the time they waited
    for the device's results within them."""
    def counters() -> dict:
        samples = metrics(server)
        return {(name, role, kind): metric_sum(samples, f"dflash_engine_{name}_total", role=role,
                                               **({"kind": kind} if kind else {}))
                for name in ("steps", "step_seconds", "step_cpu_seconds", "loop_seconds", "device_wait_seconds")
                for role in ("prefill", "decode")
                for kind in (("prompt", "decode") if name not in ("loop_seconds", "device_wait_seconds") else (None,))}

    before = counters()
    body = {"model": "tiny", "prompt": "Where does the time go", "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}
    assert httpx.post(f"{server}/v1/completions", json=body, timeout=60).status_code == 200
    deadline = time.monotonic() + 20
    while True:         # the replicas report every metrics_report_interval_s
        after = counters()
        delta = {key: after[key] - before[key] for key in after}
        if (delta[("steps", "prefill", "prompt")] >= 1 and delta[("steps", "decode", "decode")] >= 1) \
                or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert delta[("steps", "prefill", "prompt")] >= 1 and delta[("steps", "decode", "decode")] >= 1, delta
    assert delta[("steps", "prefill", "decode")] == 0        # a prefill replica never decodes
    for role, kind in (("prefill", "prompt"), ("decode", "decode")):
        assert 0 < delta[("step_cpu_seconds", role, kind)] <= delta[("step_seconds", role, kind)] + 1e-3, delta
        assert delta[("loop_seconds", role, None)] > 0
        # The wait for a step's tokens is within the steps (on CPU the read itself: short, never 0).
        steps_s = sum(delta[("step_seconds", role, k)] for k in ("prompt", "decode"))
        assert 0 < delta[("device_wait_seconds", role, None)] <= steps_s, delta
