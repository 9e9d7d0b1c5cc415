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

**Kills** (``--kill-every S``, the service on this host): meanwhile, every S seconds or so (once the service answers
``/health`` ``ok`` again after the last), one of its processes is killed with SIGKILL, drawn from ``--kill-kinds``:
an engine's process, a KV manager, a tensor-parallel rank's worker, a prefill, decode or aggregated replica (if
asked, an ingress: its clients' connections drop; or the metrics hub). Then a request may also end in a clean error
(an HTTP 5xx or a stream's error event, each with an OpenAI error object), but only one that overlapped a kill or
the ``--recovery-s`` after it; a 200 must still be its answer alone, and a cut stream, a transport error or a
request that outlasts ``--request-timeout-s`` fails. Where an ingress was killed during a request or up to
``INGRESS_GONE_S`` before it began, the HTTP front's plain 500, a dropped connection or a cut stream is allowed too:
that ingress held the client's connection. After the load the service must have every replica back (as many as
before it), the gauges must come back to 0, and each probe sent alone must give its answer alone again.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
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


# Process titles (Ray names a worker process ``ray::<actor class>[.<method>]``, a Serve replica's
# ``ray::ServeReplica:<app>:<deployment>``) of the service's processes a kill may pick.
KILLABLE = {"engine": ("ray::EngineHost",), "kv_manager": ("ray::KVManagerActor",),
            "prefill": ("ray::ServeReplica:", ":PrefillServer"), "decode": ("ray::ServeReplica:", ":DecodeServer"),
            "aggregated": ("ray::ServeReplica:", ":AggregatedServer"), "worker": ("ray::RankWorker",),
            "ingress": ("ray::ServeReplica:", ":Ingress"), "hub": ("ray::ServeReplica:", ":MetricsHub")}

# After an ingress is killed, the HTTP front (HAProxy in Serve's throughput mode) may still route a request to it
# until Serve's controller or HAProxy's own health check (every 5 s) takes it out: such a request gets the front's
# plain 500, as do the requests the dead ingress was answering (its streams are cut). Measured: the requests that
# began up to 0.07 s after the kill.
INGRESS_GONE_S = 5.0


def _health(url: str) -> tuple[int, str]:
    """/health's status code, and its ``status`` (``ok``, ``degraded``) or error message."""
    r = httpx.get(f"{url}/health", timeout=30)
    body = r.json()
    return r.status_code, body["status"] if r.status_code == 200 else body["error"]["message"]


def _victims(kinds: list[str]) -> list[tuple[int, str]]:
    """(pid, kind) of this host's processes of those kinds."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            title = (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        for kind in kinds:
            prefix, *rest = KILLABLE[kind]
            if title.startswith(prefix) and all(part in title for part in rest):
                found.append((int(entry.name), kind))
    return found


def _error_message(answer: str) -> str:
    """An error answer's message (digits as #, so that alike errors count together)."""
    try:
        text = json.loads(answer.removeprefix("stream error: "))
        text = text.get("error", text).get("message", answer) if isinstance(text, dict) else answer
    except (ValueError, AttributeError):
        text = answer
    text = re.sub(r" ?\(request [^)]*\)", "", str(text))
    return "".join("#" if c.isdigit() else c for c in text)[:140]


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
    # Long prompts, several prefill chunks each, are fitted to the service's context in ``references``.
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
                    return 200, f"stream error: {json.dumps(event['error'])}"
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
        self.kills: list[tuple[float, str]] = []     # (perf_counter time, kind) of each kill
        self.kill_failures: list[tuple[float, int, str]] = []   # (seconds after the last kill, status, message)

    def near_kill(self, start: float, end: float) -> bool:
        """Whether [start, end] overlapped a kill or the recovery time after one."""
        return any(start <= k + self.args.recovery_s and k <= end for k, _ in self.kills)

    def killed_ingress(self, start: float, end: float) -> bool:
        """Whether [start, end] overlapped an ingress's kill or the moment after it in which HTTP may still be
        routed to the dead ingress (``INGRESS_GONE_S``)."""
        return any(kind == "ingress" and start <= k + INGRESS_GONE_S and k <= end for k, kind in self.kills)

    def fail(self, what: str) -> None:
        self.outcomes["FAILED"] += 1
        if len(self.failures) < 20:
            self.failures.append(what)

    async def fit(self, session, context: int, max_tokens: int) -> None:
        """A probe whose prompt and ``max_tokens`` fill ``context`` tokens but for a token or two: the prompt's
        length in characters bisected on the tokens the service counts (a long prompt, in many prefill chunks)."""
        joined = "\n".join(json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines() if line.strip())
        joined = joined * (1 + 8 * context // max(1, len(joined)))
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
        # Two long prompts (about a third and two thirds of the context) and the longest one the context takes.
        for share, max_tokens in ((0.35, 32), (0.7, 32), (1.0, 16)):
            await self.fit(session, int(self.context * share), max_tokens)
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
            status, answer = await self.request(session, body, start)
            ok = 400 <= status < 500 and isinstance(answer, str) and '"error"' in answer
            if not ok and self.clean_failure(status, answer, start):
                return
            self.outcomes[f"bad: {status}"] += 1
            if not ok:
                self.fail(f"bad request {json.dumps(body)[:120]}: HTTP {status} {answer!s:.200}")
            return
        probe = self.rng.choice(self.probes)
        body = probe.body(self.model, stream=self.rng.random() < 0.5)
        if kind == "cancel":
            try:
                await asyncio.wait_for(self.request(session, body, start), self.rng.uniform(0.005, 1.5))
                self.outcomes["cancel: finished first"] += 1
            except asyncio.TimeoutError:
                self.outcomes["cancel: cut"] += 1
            return
        status, answer = await self.request(session, body, start)
        self.e2e.setdefault("stream" if body["stream"] else "unary", []).append(time.perf_counter() - start)
        ref = self.refs[probe]
        what = (f"{'chat' if probe.chat else 'completion'} probe ({len(probe.prompt)} characters, max_tokens "
                f"{probe.max_tokens}, {'greedy' if probe.seed is None else f'seed {probe.seed}'}, "
                f"{'streamed' if body['stream'] else 'unary'})")
        if status != 200 or not isinstance(answer, Answer):
            label = f"{'greedy' if probe.seed is None else 'seeded'}, {'streamed' if body['stream'] else 'unary'}"
            if not self.clean_failure(status, answer, start, label):
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

    async def request(self, session, body: dict, start: float) -> tuple[int, Answer | str]:
        """``_request`` under ``--request-timeout-s`` (status 0: it ran out), a transport failure as status -1
        while kills run (they can drop a connection)."""
        try:
            return await asyncio.wait_for(_request(session, self.url, body), self.args.request_timeout_s)
        except asyncio.TimeoutError:
            return 0, f"no answer within {self.args.request_timeout_s:g} s"
        except Exception as e:
            if not self.args.kill_every:
                raise
            return -1, f"{type(e).__name__}: {e}"

    def clean_failure(self, status: int, answer, start: float, kind: str = "") -> bool:
        """Whether a request that did not get its answer ended as a kill allows: near a kill, with an HTTP 5xx or a
        stream's error event carrying an OpenAI error object (a plain 5xx, a dropped connection or a cut stream only
        where an ingress was killed). Counted as such, by ``kind`` (a probe's sampling and delivery)."""
        end = time.perf_counter()
        if not self.args.kill_every or not isinstance(answer, str) or not self.near_kill(start, end):
            return False
        clean = (status >= 500 and '"error"' in answer) or (status == 200 and answer.startswith("stream error:"))
        if not clean and not ((status == -1 or status >= 500 or answer == "stream ended without [DONE]")
                              and self.killed_ingress(start, end)):
            return False
        self.outcomes[f"failed near a kill: {status if status > 0 else 'connection'}{f' ({kind})' if kind else ''}"] \
            += 1
        after = max((k for k, _ in self.kills if k <= end), default=end)
        self.kill_failures.append((end - after, status, _error_message(answer)))
        return True

    async def load(self, session) -> float:
        deadline = time.monotonic() + self.args.seconds

        async def worker() -> None:
            while time.monotonic() < deadline:
                try:
                    await self.one(session)
                except Exception as e:      # a transport failure (not a cancel of ours)
                    self.fail(f"{type(e).__name__}: {e}")

        start = time.monotonic()
        workers = [worker() for _ in range(self.args.concurrency)]
        if self.args.kill_every:
            workers.append(self.killer(session, deadline))
        await asyncio.gather(*workers)
        return time.monotonic() - start

    async def killer(self, session, deadline: float) -> None:
        """SIGKILL one of the service's processes every ``--kill-every`` seconds or so, each once ``/health``
        answers ``ok`` again after the one before, none in the load's last ``--recovery-s``."""
        while True:
            await asyncio.sleep(self.args.kill_every * self.rng.uniform(0.5, 1.5))
            while time.monotonic() < deadline - self.args.recovery_s:
                async with session.get(f"{self.url}/health") as r:      # every role up, not "degraded"
                    if r.status == 200 and (await r.json())["status"] == "ok":
                        break
                await asyncio.sleep(1.0)
            if time.monotonic() >= deadline - self.args.recovery_s:
                return
            victims = _victims(self.args.kill_kinds)
            if not victims:
                self.fail(f"no process of {self.args.kill_kinds} to kill on this host (is the service local?)")
                return
            pid, kind = self.rng.choice(victims)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            self.kills.append((time.perf_counter(), kind))
            print(f"{time.strftime('%H:%M:%S')} killed a {kind} process ({pid})", flush=True)

    async def recovered(self, session, replicas: dict[str, float]) -> None:
        """After kills: every replica back (as many per role as before the load) within ``--recovery-s``, then
        each probe sent alone gives its answer alone."""
        deadline = time.monotonic() + self.args.recovery_s
        while (now := _replicas(self.url)) != replicas or _health(self.url) != (200, "ok"):
            if time.monotonic() > deadline:
                self.fail(f"{self.args.recovery_s:g} s after the load: replicas {now}, before it {replicas}")
                return
            await asyncio.sleep(1.0)
        for probe, ref in self.refs.items():
            status, answer = await _request(session, self.url, probe.body(self.model, stream=False))
            if answer != ref:
                self.fail(f"after the kills, a {len(probe.prompt)}-character probe alone: HTTP {status} "
                          f"{answer!s:.200} against {ref.text[:60]!r}")
            else:
                self.outcomes["probe after the kills: same as alone"] += 1


def _gauges(url: str) -> dict[str, float]:
    """Pages in use, and requests running and waiting, summed over every replica and pool."""
    from prometheus_client.parser import text_string_to_metric_families

    sums = {"dflash_kv_pages_in_use": 0.0, "dflash_num_requests_running": 0.0, "dflash_num_requests_waiting": 0.0}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for s in family.samples:
            if s.name in sums:
                sums[s.name] += s.value
    return sums


def _replicas(url: str) -> dict[str, float]:
    """Healthy engine replicas per role, as the ingress reports them."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for s in family.samples:
            if s.name == "dflash_num_replicas":
                found[s.labels["role"]] = found.get(s.labels["role"], 0.0) + s.value
    return found


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
    p.add_argument("--kill-every", type=float, default=0.0, metavar="S",
                   help="SIGKILL one of the service's processes (on this host) every S seconds or so; 0: none")
    p.add_argument("--kill-kinds", nargs="+", choices=sorted(KILLABLE),
                   default=["engine", "kv_manager", "prefill", "decode", "aggregated", "worker"],
                   help="which processes a kill may pick (those the service has)")
    p.add_argument("--recovery-s", type=float, default=90.0,
                   help="with kills: how long after one a request may fail, and the service may take to recover")
    p.add_argument("--request-timeout-s", type=float, default=300.0, help="a request taking longer fails")
    args = p.parse_args()
    url = args.url.rstrip("/")
    model_card = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]
    soak = Soak(args, model_card["id"], model_card.get("max_model_len") or 2048)

    replicas = _replicas(url)

    async def run() -> float:
        async with client_session(600) as session:
            await soak.references(session)
            duration = await soak.load(session)
            if soak.kills:
                await soak.recovered(session, replicas)
            return duration

    duration = asyncio.run(run())
    settle_s = max(args.settle_s, 60.0) if soak.kills else args.settle_s     # a dead reader's holds time out (30 s)
    settled, gauges = settle(url, settle_s)
    if not settled:
        soak.fail(f"after {settle_s:g} s without load: {gauges}")
    health = _health(url)
    if health != (200, "ok"):
        soak.fail(f"/health: {health}")

    total = sum(soak.outcomes.values())
    lengths = [a.prompt_tokens for a in soak.refs.values()] or [0]
    print(f"{total} requests in {duration:.0f} s, {args.concurrency} at a time; {len(soak.probes)} probes of "
          f"{min(lengths)}-{max(lengths)} prompt tokens (context {soak.context})")
    if args.kill_every:
        print(f"{len(soak.kills)} processes killed: " + ", ".join(f"{kind} {k - soak.kills[0][0]:+.0f} s"
                                                                 for k, kind in soak.kills))
        errors = Counter((status, message) for _, status, message in soak.kill_failures)
        if errors:
            late = sorted(after for after, _, _ in soak.kill_failures)
            print(f"requests that failed near a kill ended {late[0]:.1f} to {late[-1]:.1f} s after it (median "
                  f"{late[len(late) // 2]:.1f}); their errors:")
            for (status, message), n in errors.most_common(8):
                print(f"  {n} x {status}: {message}")
    print("| outcome | requests |\n|---|---|")
    for outcome, n in sorted(soak.outcomes.items()):
        print(f"| {outcome} | {n} |")
    for mode, values in sorted(soak.e2e.items()):
        pct = _pct(values)
        print(f"probe end-to-end, {mode}: p50 {pct['p50'] * 1e3:.0f} ms, p90 {pct['p90'] * 1e3:.0f} ms, p99 "
              f"{pct['p99'] * 1e3:.0f} ms ({len(values)})")
    print(f"after the load: {'every gauge back to 0' if settled else gauges}; /health {health}")
    if soak.failures:
        print(f"\n{soak.outcomes['FAILED']} FAILED, the first {len(soak.failures)}:")
        for failure in soak.failures:
            print(f"- {failure}")
        return 1
    print("every check passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
