"""A soak of a running service, as its users would load it: mixed requests for a while, then the checks.

    scripts/serve                                                   # one shell
    .venv/bin/python benchmarks/soak.py --seconds 600               # another (PYTHONPATH=. from elsewhere)

``--concurrency`` workers send requests back to back until ``--seconds`` have passed, each drawn at random:
- **probes**: a fixed set of prompts (held-out code, and long ones that take several prefill chunks, up to near the
  context limit), greedy or seeded sampling, to ``/v1/completions`` or ``/v1/chat/completions``, streamed or not.
  Each probe's answer was taken once, alone on the idle service, before the load; under load it must be the same
  text, finish reason and token count. Another request's KV read by mistake, a lost chunk, a cut stream or a
  stop in the wrong place each show here;
- **cancels**: a probe whose client goes away after a random time (a disconnect mid-prefill, mid-transfer or
  mid-decode);
- **bad requests**: bodies the service must refuse with a 4xx and an OpenAI error object, changing nothing.

Then, with the load stopped: the KV pages in use on every replica must come back to 0 (within ``--settle-s``), no
request may be left running or waiting, and ``/health`` must answer. Exits 1 when any check failed, with the first
failures printed; prints requests and outcomes by kind, and end-to-end latency percentiles.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx

from serve_app.bench import _pct, _sse_data, client_session

PROMPTS = Path(__file__).resolve().parent / "prompts" / "heldout.jsonl"


@dataclass(frozen=True)
class Probe:
    prompt: str
    chat: bool
    max_tokens: int
    seed: int | None        # None: greedy

    def body(self, model: str, stream: bool) -> dict:
        body = {"model": model, "max_tokens": self.max_tokens, "stream": stream}
        if self.chat:
            body["messages"] = [{"role": "user", "content": self.prompt}]
        else:
            body["prompt"] = self.prompt
        if self.seed is None:
            body["temperature"] = 0
        else:
            body.update(temperature=0.8, top_p=0.95, seed=self.seed)
        return body


@dataclass
class Answer:
    text: str
    finish_reason: str | None
    completion_tokens: int | None
    prompt_tokens: int | None


def _bad_bodies(model: str, context: int) -> list[dict]:
    long = "x = 1\n" * (context * 2)        # well past the context whatever the tokenizer
    return [{"model": model, "prompt": "a", "max_tokens": -3},
            {"model": "no-such-model", "prompt": "a", "max_tokens": 4},
            {"model": model, "prompt": "a", "temperature": "hot"},
            {"model": model},
            {"model": model, "prompt": long, "max_tokens": 8},
            {"model": model, "prompt": "a", "max_tokens": context * 4},
            {"model": model, "messages": [{"role": "nobody", "content": "hi"}], "max_tokens": 4},
            {"model": model, "prompt": "a", "max_tokens": 4, "top_p": 7}]


def _probes(context: int, rng: random.Random) -> list[Probe]:
    texts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines() if line.strip()]
    rng.shuffle(texts)
    probes = []
    for i, text in enumerate(texts[:12]):
        probes.append(Probe(text, chat=i % 3 == 2, max_tokens=rng.choice((1, 2, 16, 48, 96)),
                            seed=None if i % 4 else 1000 + i))
    # Long prompts, several prefill chunks each (the one that ends at the context limit is fitted in ``references``).
    joined = "\n".join(texts)
    for chars in (2500, 4500):
        probes.append(Probe(joined[:chars], chat=False, max_tokens=32, seed=None))
    return probes


def _answer_of(body: dict, stream_events: list[dict] | None, data: dict | None) -> Answer:
    key = "message" if "messages" in body else None
    if stream_events is None:
        choice = data["choices"][0]
        text = choice["message"]["content"] if key else choice["text"]
        return Answer(text or "", choice["finish_reason"], data["usage"]["completion_tokens"],
                      data["usage"]["prompt_tokens"])
    text, finish, tokens, prompt_tokens = [], None, None, None
    for event in stream_events:
        if event.get("usage"):
            tokens, prompt_tokens = event["usage"]["completion_tokens"], event["usage"]["prompt_tokens"]
        for choice in event.get("choices", []):
            part = choice.get("delta", {}).get("content") if key else choice.get("text")
            text.append(part or "")
            finish = choice.get("finish_reason") or finish
    return Answer("".join(text), finish, tokens, prompt_tokens)


async def _request(session, url: str, body: dict) -> tuple[int, Answer | str]:
    """(HTTP status, the answer) or (status, an error text)."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    if body.get("stream"):
        body = {**body, "stream_options": {"include_usage": True}}
    async with session.post(url + path, json=body) as r:
        if r.status != 200:
            return r.status, (await r.read()).decode(errors="replace")[:300]
        if not body.get("stream"):
            return 200, _answer_of(body, None, await r.json())
        events, buffer, done = [], bytearray(), False
        async for data in r.content.iter_any():
            done = done or b"data: [DONE]" in data
            for payload in _sse_data(buffer, data):
                event = json.loads(payload)
                if "error" in event:
                    return 200, f"stream error: {event['error']}"
                events.append(event)
        if not done:
            return 200, "stream ended without [DONE]"
        return 200, _answer_of(body, events, None)


class Soak:
    def __init__(self, args, model: str, context: int):
        self.args, self.model, self.url, self.context = args, model, args.url.rstrip("/"), context
        self.rng = random.Random(args.seed)
        self.probes = _probes(context, self.rng)
        self.bad = _bad_bodies(model, context)
        self.refs: dict[Probe, Answer] = {}
        self.outcomes: Counter = Counter()
        self.failures: list[str] = []
        self.e2e: dict[str, list[float]] = {}

    def fail(self, what: str) -> None:
        self.outcomes["FAILED"] += 1
        if len(self.failures) < 20:
            self.failures.append(what)

    async def fit(self, session, context: int) -> None:
        """A probe whose prompt and ``max_tokens`` fill the context but for a token or two: the prompt's length in
        characters bisected on the tokens the service counts (its longest prompt, in many prefill chunks)."""
        joined = "\n".join(json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines() if line.strip())
        joined = joined * (1 + 8 * context // max(1, len(joined)))
        max_tokens = 16
        most = context - max_tokens
        lo, hi = 0, len(joined)
        while hi - lo > 1:
            probe = Probe(joined[:(lo + hi) // 2], chat=False, max_tokens=max_tokens, seed=None)
            status, answer = await _request(session, self.url, {**probe.body(self.model, False), "max_tokens": 1})
            tokens = answer.prompt_tokens if status == 200 and isinstance(answer, Answer) else None
            if tokens is not None and most - 2 <= tokens <= most:
                self.probes.append(probe)
                return
            if tokens is None or tokens > most:
                hi = (lo + hi) // 2
            else:
                lo = (lo + hi) // 2
        self.fail(f"no prompt of {most - 2}-{most} tokens was found")

    async def references(self, session) -> None:
        """Each probe's answer alone on the idle service (not streamed)."""
        await self.fit(session, self.context)
        for probe in list(self.probes):
            status, answer = await _request(session, self.url, probe.body(self.model, stream=False))
            if status == 200 and isinstance(answer, Answer):
                self.refs[probe] = answer
            else:
                self.fail(f"a {len(probe.prompt)}-character probe alone: HTTP {status} {answer!s:.300}")
                self.probes.remove(probe)

    async def one(self, session) -> None:
        roll = self.rng.random()
        kind = "bad" if roll < self.args.bad else "cancel" if roll < self.args.bad + self.args.cancel else "probe"
        start = time.perf_counter()
        if kind == "bad":
            body = self.rng.choice(self.bad)
            status, answer = await _request(session, self.url, body)
            ok = 400 <= status < 500 and isinstance(answer, str) and '"error"' in answer
            self.outcomes[f"bad: {status}"] += 1
            if not ok:
                self.fail(f"bad request {json.dumps(body)[:120]}: HTTP {status} {answer!s:.200}")
            return
        probe = self.rng.choice(self.probes)
        body = probe.body(self.model, stream=self.rng.random() < 0.5)
        if kind == "cancel":
            try:
                await asyncio.wait_for(_request(session, self.url, body), self.rng.uniform(0.005, 1.5))
                self.outcomes["cancel: finished first"] += 1
            except asyncio.TimeoutError:
                self.outcomes["cancel: cut"] += 1
            return
        status, answer = await _request(session, self.url, body)
        self.e2e.setdefault("stream" if body["stream"] else "unary", []).append(time.perf_counter() - start)
        ref = self.refs[probe]
        what = (f"{'chat' if probe.chat else 'completion'} probe ({len(probe.prompt)} characters, max_tokens "
                f"{probe.max_tokens}, {'greedy' if probe.seed is None else f'seed {probe.seed}'}, "
                f"{'streamed' if body['stream'] else 'unary'})")
        if status != 200 or not isinstance(answer, Answer):
            self.fail(f"{what}: HTTP {status} {answer!s:.300}")
            return
        if answer != ref and probe.seed is not None and self.args.lenient_seeded:
            self.outcomes["probe: seeded, differs from alone (counted, --lenient-seeded)"] += 1
            return
        if answer != ref:
            same = next((i for i, (a, b) in enumerate(zip(answer.text, ref.text)) if a != b),
                        min(len(answer.text), len(ref.text)))
            self.fail(f"{what}: differs from its answer alone at character {same}: {answer.text[same:same + 40]!r} "
                      f"against {ref.text[same:same + 40]!r} (finish {answer.finish_reason} / {ref.finish_reason}, "
                      f"tokens {answer.completion_tokens} / {ref.completion_tokens})")
            return
        self.outcomes["probe: same as alone"] += 1

    async def load(self, session) -> float:
        deadline = time.monotonic() + self.args.seconds

        async def worker() -> None:
            while time.monotonic() < deadline:
                try:
                    await self.one(session)
                except Exception as e:      # a transport failure (not a cancel of ours)
                    self.fail(f"{type(e).__name__}: {e}")

        start = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(self.args.concurrency)))
        return time.monotonic() - start


def _gauges(url: str) -> dict[str, float]:
    """Pages in use, and requests running and waiting, summed over every replica and pool."""
    from prometheus_client.parser import text_string_to_metric_families

    sums = {"dflash_kv_pages_in_use": 0.0, "dflash_num_requests_running": 0.0, "dflash_num_requests_waiting": 0.0}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for s in family.samples:
            if s.name in sums:
                sums[s.name] += s.value
    return sums


def settle(url: str, seconds: float) -> tuple[bool, dict[str, float]]:
    """Whether every gauge came back to 0 within ``seconds`` (the replicas push theirs every second or so)."""
    deadline = time.monotonic() + seconds
    while True:
        gauges = _gauges(url)
        if not any(gauges.values()):
            return True, gauges
        if time.monotonic() > deadline:
            return False, gauges
        time.sleep(1.0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--seconds", type=float, default=300.0, help="how long the load runs")
    p.add_argument("--concurrency", type=int, default=12)
    p.add_argument("--cancel", type=float, default=0.2, help="share of requests whose client goes away")
    p.add_argument("--bad", type=float, default=0.05, help="share of requests the service must refuse")
    p.add_argument("--settle-s", type=float, default=30.0,
                   help="how long the gauges may take to come back to 0 after the load")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lenient-seeded", action="store_true",
                   help="count a seeded probe that differs from its answer alone instead of failing: without "
                        "batch-invariant kernels a float-level difference can flip a near-tied draw "
                        "(benchmarks/README.md, Soak); greedy probes stay strict")
    args = p.parse_args()
    url = args.url.rstrip("/")
    model_card = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]
    soak = Soak(args, model_card["id"], model_card.get("max_model_len") or 2048)

    async def run() -> float:
        async with client_session(600) as session:
            await soak.references(session)
            return await soak.load(session)

    duration = asyncio.run(run())
    settled, gauges = settle(url, args.settle_s)
    if not settled:
        soak.fail(f"after {args.settle_s:g} s without load: {gauges}")
    health = httpx.get(f"{url}/health", timeout=30)
    if health.status_code != 200:
        soak.fail(f"/health: HTTP {health.status_code} {health.text[:200]}")

    total = sum(soak.outcomes.values())
    lengths = [a.prompt_tokens for a in soak.refs.values()] or [0]
    print(f"{total} requests in {duration:.0f} s, {args.concurrency} at a time; {len(soak.probes)} probes of "
          f"{min(lengths)}-{max(lengths)} prompt tokens (context {soak.context})")
    print("| outcome | requests |\n|---|---|")
    for outcome, n in sorted(soak.outcomes.items()):
        print(f"| {outcome} | {n} |")
    for mode, values in sorted(soak.e2e.items()):
        pct = _pct(values)
        print(f"probe end-to-end, {mode}: p50 {pct['p50'] * 1e3:.0f} ms, p90 {pct['p90'] * 1e3:.0f} ms, p99 "
              f"{pct['p99'] * 1e3:.0f} ms ({len(values)})")
    print(f"after the load: {'every gauge back to 0' if settled else gauges}; /health {health.status_code}")
    if soak.failures:
        print(f"\n{soak.outcomes['FAILED']} FAILED, the first {len(soak.failures)}:")
        for failure in soak.failures:
            print(f"- {failure}")
        return 1
    print("every check passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
