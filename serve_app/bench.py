"""``dflash-serve bench``: a streaming load client for an OpenAI-compatible server.

Reports TTFT, TPOT, ITL and end-to-end percentiles, throughput, and the acceptance length computed from
the responses' spec-decode usage (or, from a server whose responses lack it, its /metrics counter deltas; mean AL
= 1 + accepted / drafts), as a table, JSON and a PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

PERCENTILES = (50, 90, 99)


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="default: the server's first model")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second (default inf: all at once, bounded by --max-concurrency)")
    p.add_argument("--arrival", choices=["poisson", "fixed"], default="poisson",
                   help="inter-arrival times at --request-rate: exponential or constant")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--input-len", type=int, default=64, help="prompt tokens (random token ids)")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens (with ignore_eos)")
    p.add_argument("--prompt-file", default=None, help="text prompts, one per line or JSON lines with 'prompt'")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--label", default=None, help="a name for this run in the table, JSON and plot")
    p.add_argument("--json", dest="json_out", default=None, help="write the results here")
    p.add_argument("--plot", default=None, help="write a PNG of the latency distributions here")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--client-processes", type=int, default=1,
                   help="load client processes sharing the requests and the concurrency: one Python process parses "
                        "a few thousand SSE events a second at most, and the server must be the bound, not the client")


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""
    spec: tuple[float, float] | None = None     # (drafts, accepted tokens) from the response's usage, if it has them

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def _prompts(args, vocab_hint: int = 100) -> list:
    rng = random.Random(args.seed)
    if args.prompt_file:
        lines = [line for line in Path(args.prompt_file).read_text().splitlines() if line.strip()]
        texts = [json.loads(line)["prompt"] if line.lstrip().startswith("{") else line for line in lines]
        return [texts[i % len(texts)] for i in range(args.num_requests)]
    # Token ids from a small range: valid for any vocabulary, and no tokenizer needed.
    return [[rng.randrange(4, vocab_hint) for _ in range(args.input_len)] for _ in range(args.num_requests)]


def client_session(timeout_s: float = 600.0):
    """The load client's HTTP session: aiohttp, whose C parser takes well under half of httpx's CPU per streamed
    event (measured in benchmarks/README.md), so a client beside the server on one host takes fewer of its cores.
    No connection limit: the concurrency is the caller's."""
    import aiohttp

    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=None, sock_connect=timeout_s,
                                                               sock_read=timeout_s))


def _sse_data(buffer: bytearray, data: bytes):
    """The ``data:`` payloads of the complete lines in ``buffer + data``; the unfinished tail stays in ``buffer``."""
    buffer += data
    end = buffer.rfind(b"\n")
    if end < 0:
        return []
    lines = bytes(buffer[:end]).split(b"\n")
    del buffer[:end + 1]
    out = []
    for line in lines:
        line = line.rstrip(b"\r")
        if line.startswith(b"data:"):
            payload = line[5:].lstrip(b" ")
            if payload != b"[DONE]":
                out.append(payload)
    return out


async def _one(session, url: str, model: str, prompt, args) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": args.output_len, "temperature": args.temperature,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    last = None
    result = RequestResult(ok=False)
    try:
        async with session.post(f"{url}/v1/completions", json=body) as r:
            if r.status != 200:
                result.error = f"HTTP {r.status}: {(await r.read()).decode(errors='replace')[:200]}"
                return result
            buffer = bytearray()
            async for data in r.content.iter_any():
                for payload in _sse_data(buffer, data):
                    event = json.loads(payload)
                    if "error" in event:
                        result.error = event["error"]["message"]
                        return result
                    if event.get("usage"):
                        result.prompt_tokens = event["usage"]["prompt_tokens"]
                        result.output_tokens = event["usage"]["completion_tokens"]
                        spec = event["usage"].get("spec_decode")
                        if spec:
                            result.spec = (spec["num_drafts"], spec["accepted_tokens"])
                    if event["choices"] and event["choices"][0]["text"]:
                        now = time.perf_counter()
                        if last is None:
                            result.ttft = now - start
                        else:
                            result.itl.append(now - last)
                        last = now
    except Exception as e:     # a failed request is counted and reported, not fatal to the run
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.e2e = time.perf_counter() - start
    result.ok = True
    return result


def _spec_counters(url: str) -> tuple[float, float]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    drafts = accepted = 0.0
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for s in family.samples:
            if s.name == "dflash_spec_decode_num_drafts_total":
                drafts += s.value
            elif s.name == "dflash_spec_decode_num_accepted_tokens_total":
                accepted += s.value
    return drafts, accepted


def _pct(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {f"p{p}": None for p in PERCENTILES} | {"mean": None}
    ordered = sorted(values)
    out = {f"p{p}": ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))] for p in PERCENTILES}
    out["mean"] = statistics.fmean(values)
    return out


async def _run(args, model: str, prompts: list) -> tuple[list[RequestResult], float]:
    limit = asyncio.Semaphore(args.max_concurrency or len(prompts))
    rng = random.Random(args.seed + 1)
    bar = None
    if not args.no_progress:
        from tqdm import tqdm
        bar = tqdm(total=len(prompts), desc=args.label or "bench", unit="req")

    async with client_session() as session:
        async def limited(prompt):
            async with limit:
                res = await _one(session, args.url, model, prompt, args)
            if bar is not None:
                bar.update(1)
            return res

        tasks = []
        start = time.perf_counter()
        for i, prompt in enumerate(prompts):
            tasks.append(asyncio.create_task(limited(prompt)))
            if args.request_rate != float("inf") and i < len(prompts) - 1:
                gap = 1.0 / args.request_rate
                await asyncio.sleep(rng.expovariate(args.request_rate) if args.arrival == "poisson" else gap)
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    if bar is not None:
        bar.close()
    return list(results), duration


def _shares(args, prompts: list) -> list[tuple[argparse.Namespace, list]]:
    """Per client process: its arguments (a share of the concurrency and request rate) and its prompts."""
    n = max(1, min(args.client_processes, len(prompts), args.max_concurrency or len(prompts)))
    shares = []
    for i in range(n):
        share = argparse.Namespace(**vars(args))
        if args.max_concurrency:
            share.max_concurrency = args.max_concurrency // n + (i < args.max_concurrency % n)
        share.request_rate = args.request_rate / n
        share.seed = args.seed + i
        share.no_progress = args.no_progress or i > 0
        shares.append((share, prompts[i::n]))
    return shares


def _warm_up(_: int) -> None:
    import aiohttp  # noqa: F401


def _run_share(args, model: str, prompts: list, start_at: float) -> tuple[list[RequestResult], float, float]:
    """One client process's share, started at the wall-clock time ``start_at`` (every share at once)."""
    time.sleep(max(0.0, start_at - time.time()))
    began = time.time()
    results, _ = asyncio.run(_run(args, model, prompts))
    return results, began, time.time()


def _run_all(args, model: str, prompts: list) -> tuple[list[RequestResult], float]:
    shares = _shares(args, prompts)
    if len(shares) == 1:
        return asyncio.run(_run(args, model, prompts))
    import concurrent.futures
    import multiprocessing

    # Spawned, not forked: the calling process may hold Ray's threads and sockets.
    with concurrent.futures.ProcessPoolExecutor(len(shares), mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(_warm_up, range(len(shares))))          # processes up and aiohttp imported before the clock
        start_at = time.time() + 0.5
        done = list(pool.map(_run_share, *zip(*[(a, model, p, start_at) for a, p in shares])))
    results = [r for share, _, _ in done for r in share]
    return results, max(end for _, _, end in done) - min(began for _, began, _ in done)


def bench(args: argparse.Namespace) -> dict:
    """Run one load test; returns the summary dict (what ``--json`` writes)."""
    import httpx

    if args.num_requests < 1 or args.input_len < 1 or args.output_len < 1 or args.client_processes < 1:
        raise ValueError("--num-requests, --input-len, --output-len and --client-processes must be >= 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1 (leave it out for no limit)")
    try:      # the server is there before any load starts, or the run stops with one line saying why
        models = httpx.get(f"{args.url}/v1/models", timeout=30)
        models.raise_for_status()
    except httpx.HTTPError as e:
        raise ValueError(f"no OpenAI-compatible server answers at {args.url}: {type(e).__name__}: {e}") from None
    model = args.model or models.json()["data"][0]["id"]
    prompts = _prompts(args)
    before = _spec_counters(args.url)
    results, duration = _run_all(args, model, prompts)
    after = _spec_counters(args.url)
    ok = [r for r in results if r.ok]
    # Each response's own usage when every one has it: exact whatever serves /metrics (with several ingress
    # replicas a scrape holds the others' counts as of their last report, up to a report interval old).
    source = "usage" if ok and all(r.spec is not None for r in ok) else "metrics"
    if source == "usage":
        drafts, accepted = sum(r.spec[0] for r in ok), sum(r.spec[1] for r in ok)
    else:
        drafts, accepted = after[0] - before[0], after[1] - before[1]
    output_tokens = sum(r.output_tokens for r in ok)
    return {
        "label": args.label, "url": args.url, "model": model, "num_requests": len(results),
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "max_concurrency": args.max_concurrency, "request_rate": args.request_rate, "input_len": args.input_len,
        "output_len": args.output_len, "duration_s": duration, "client_processes": len(_shares(args, prompts)),
        "request_throughput": len(ok) / duration, "output_throughput": output_tokens / duration,
        "total_token_throughput": (output_tokens + sum(r.prompt_tokens for r in ok)) / duration,
        "ttft_s": _pct([r.ttft for r in ok]), "tpot_s": _pct([r.tpot for r in ok if r.tpot is not None]),
        "itl_s": _pct([g for r in ok for g in r.itl]), "e2e_s": _pct([r.e2e for r in ok]),
        "spec_decode": {"num_drafts": drafts, "accepted_tokens": accepted, "source": source,
                        "mean_acceptance_length": (1 + accepted / drafts) if drafts else None},
        "_samples": {"ttft": [r.ttft for r in ok], "tpot": [r.tpot for r in ok if r.tpot is not None],
                     "e2e": [r.e2e for r in ok]},
    }


def format_table(summaries: list[dict]) -> str:
    def ms(v):
        return "-" if v is None else f"{v * 1000:.1f}"

    head = ("| run | conc | ok | req/s | out tok/s | TTFT p50 | TTFT p90 | TTFT p99 | TPOT p50 | TPOT p90 | "
            "TPOT p99 | ITL p50 | ITL p99 | E2E p50 | E2E p99 | AL |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for s in summaries:
        al = s["spec_decode"]["mean_acceptance_length"]
        lines.append(
            f"| {s['label'] or '-'} | {s['max_concurrency'] or 'inf'} | {s['completed']}/{s['num_requests']} | "
            f"{s['request_throughput']:.2f} | {s['output_throughput']:.1f} | "
            + " | ".join(ms(s[k][p]) for k, p in (("ttft_s", "p50"), ("ttft_s", "p90"), ("ttft_s", "p99"),
                                                  ("tpot_s", "p50"), ("tpot_s", "p90"), ("tpot_s", "p99"),
                                                  ("itl_s", "p50"), ("itl_s", "p99"), ("e2e_s", "p50"),
                                                  ("e2e_s", "p99")))
            + f" | {'-' if al is None else f'{al:.3f}'} |")
    return "\n".join(lines) + "\n(latencies in ms)"


def plot(summaries: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, key, title in zip(axes, ("ttft", "tpot", "e2e"), ("TTFT", "TPOT", "end-to-end")):
        for s in summaries:
            values = sorted(v * 1000 for v in s["_samples"][key])
            if values:
                ax.plot(values, [(i + 1) / len(values) for i in range(len(values))],
                        label=f"{s['label'] or s['url']} (c={s['max_concurrency'] or 'inf'})")
        ax.set_xlabel(f"{title} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{title} CDF")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def public(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if not k.startswith("_")}


def run_bench(args: argparse.Namespace) -> int:
    summary = bench(args)
    print(format_table([summary]))
    print(json.dumps(public(summary), indent=1))
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(public(summary), indent=1))
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot([summary], args.plot)
    return 0 if summary["completed"] else 1
