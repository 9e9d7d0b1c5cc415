"""Aggregated vs disaggregated over HTTP, and the offline engine on the same prompts, in one run.

Starts a local Ray cluster, deploys both applications side by side (/agg and /disagg), runs
``dflash-serve bench`` against each at every concurrency, then the offline ``LLM`` on the same prompts.

Ray starts its workers (every replica, the ingress, the HTTP proxy) at nice 15 unless told otherwise, while the
offline engine and the load client run in this process at nice 0: on a shared machine any other process, and
the load client itself, would then take the CPU from the service and not from the offline engine. The service's
workers run at ``--worker-niceness`` (default 0, the offline engine's) so the ratio measures the serving path.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from serve_app.metrics import HANDOFF_PHASES  # noqa: E402


def _pair(args) -> tuple[str, str, str]:
    demo = REPO / "models" / "demo"
    if not args.tiny and (demo / "target").is_dir() and (demo / "drafter").is_dir():
        return str(demo / "target"), str(demo / "drafter"), "demo"
    from tests.test_serve_support import write_tiny_pair

    target, drafter = write_tiny_pair(Path(tempfile.mkdtemp(prefix="serve_bench_")))
    return str(target), str(drafter), "tiny-random"


def _bench_args(url: str, label: str, concurrency: int, args) -> argparse.Namespace:
    from serve_app.bench import add_bench_args

    p = argparse.ArgumentParser()
    add_bench_args(p)
    prompts = ["--prompt-file", args.prompt_file] if args.prompt_file else ["--input-len", str(args.input_len)]
    return p.parse_args(["--url", url, "--label", label, "--max-concurrency", str(concurrency),
                         "--num-requests", str(max(args.min_requests, 2 * concurrency)), *prompts,
                         "--output-len", str(args.output_len), "--seed", "0", "--no-progress",
                         "--client-processes", str(getattr(args, "client_processes", 1))])


def _offline(target: str, drafter: str, prompts: list, concurrency: int, output_len: int) -> dict:
    """The engine alone: batches of ``concurrency`` prompts through ``LLM.generate``."""
    from engine.sequence import SamplingParams
    from spec_decode import LLM

    llm = _offline.cache.get((target, drafter)) or LLM(target, draft=drafter, num_pages=256)
    _offline.cache[(target, drafter)] = llm
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:1], params)          # warm-up
    start = time.perf_counter()
    tokens, drafts, accepted, e2e = 0, 0, 0, []
    for i in range(0, len(prompts), concurrency):
        t0 = time.perf_counter()
        outs = llm.generate(prompts[i:i + concurrency], params)
        e2e.extend([time.perf_counter() - t0] * len(outs))
        tokens += sum(len(o.token_ids) for o in outs)
        drafts += sum(o.spec.num_drafts for o in outs)
        accepted += sum(o.spec.num_accepted_tokens for o in outs)
    duration = time.perf_counter() - start
    e2e.sort()
    return {"label": "offline", "max_concurrency": concurrency, "num_requests": len(prompts),
            "request_throughput": len(prompts) / duration, "output_throughput": tokens / duration,
            "e2e_p50_s": e2e[len(e2e) // 2], "mean_acceptance_length": 1 + accepted / drafts if drafts else None}


_offline.cache = {}


# /metrics histograms read around each run: (sum, count) deltas give the run's means. A value is a histogram's name,
# or its name and one label's value (``phase`` of the hand-off's phases).
HISTOGRAMS = {"read_s": "dflash_kv_transfer_latency_seconds", "ttft_s": "dflash_time_to_first_token_seconds",
              "queue_s": "dflash_request_queue_time_seconds", "prefill_s": "dflash_request_prefill_time_seconds",
              "decode_s": "dflash_request_decode_time_seconds", "e2e_s": "dflash_e2e_request_latency_seconds",
              "handoff_s": "dflash_kv_handoff_seconds",
              **{f"handoff_{p}_s": ("dflash_kv_handoff_phase_seconds", p) for p in HANDOFF_PHASES}}


def _histograms(url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of each of HISTOGRAMS from the service's /metrics."""
    import httpx

    from tests.test_serve_support import metric_samples, metric_sum

    samples = metric_samples(httpx.get(f"{url}/metrics", timeout=30).text)
    sums = {}
    for key, name in HISTOGRAMS.items():
        name, labels = (name, {}) if isinstance(name, str) else (name[0], {"phase": name[1]})
        sums[key] = (metric_sum(samples, f"{name}_sum", **labels), metric_sum(samples, f"{name}_count", **labels))
    return sums


REPORT_INTERVAL_S = 1.0      # the replicas' metrics period in the benchmarked applications

# The engine loops' counters (``serve_app.metrics.LOOP_COUNTERS``) read around each run, per role: key -> series.
LOOP_SERIES = {"prompt_steps": ("dflash_engine_steps_total", "prompt"),
               "decode_steps": ("dflash_engine_steps_total", "decode"),
               "prompt_step_s": ("dflash_engine_step_seconds_total", "prompt"),
               "decode_step_s": ("dflash_engine_step_seconds_total", "decode"),
               "prompt_cpu_s": ("dflash_engine_step_cpu_seconds_total", "prompt"),
               "decode_cpu_s": ("dflash_engine_step_cpu_seconds_total", "decode"),
               "idle_s": ("dflash_engine_idle_seconds_total", None),
               "device_wait_s": ("dflash_engine_device_wait_seconds_total", None),
               "thread_cpu_s": ("dflash_engine_thread_cpu_seconds_total", None),
               "process_cpu_s": ("dflash_engine_process_cpu_seconds_total", None)}


def _loops(url: str) -> dict[str, dict[str, float]]:
    """Per engine role, LOOP_SERIES from the service's /metrics (as the replicas last reported them)."""
    import httpx

    from tests.test_serve_support import metric_samples, metric_sum

    samples = metric_samples(httpx.get(f"{url}/metrics", timeout=30).text)
    roles = {dict(labels)["role"] for name, labels in samples if name == "dflash_engine_steps_total"}
    return {role: {key: metric_sum(samples, name, role=role, **({"kind": kind} if kind else {}))
                   for key, (name, kind) in LOOP_SERIES.items()} for role in sorted(roles)}


def loop_deltas(before: dict, after: dict, duration_s: float) -> dict[str, dict]:
    """Per role, the run's engine loop figures: steps of each kind, their mean wall time and the share of it the
    engine thread spent on the core, the time a step waited for the device's results, the steps' share of the run's
    wall time, and the engine processes' CPU."""
    rows = {}
    for role, values in after.items():
        d = {k: v - before.get(role, {}).get(k, 0.0) for k, v in values.items()}
        row = {"prompt_steps": d["prompt_steps"], "decode_steps": d["decode_steps"],
               "steps_share": (d["prompt_step_s"] + d["decode_step_s"]) / duration_s,
               "idle_s": d["idle_s"], "thread_cpu": d["thread_cpu_s"] / duration_s,
               "device_wait_ms": d["device_wait_s"] / steps * 1e3 if (steps := d["prompt_steps"] + d["decode_steps"])
               else None,
               "process_cpu": d["process_cpu_s"] / duration_s}
        for kind in ("prompt", "decode"):
            n, wall = d[f"{kind}_steps"], d[f"{kind}_step_s"]
            row[f"{kind}_step_ms"] = wall / n * 1e3 if n else None
            row[f"{kind}_on_core"] = d[f"{kind}_cpu_s"] / wall if wall else None
        rows[role] = row
    return rows


def format_loops(rows: dict[str, dict]) -> str:
    def f(v, spec):
        return "-" if v is None else format(v, spec)

    return "\n".join(
        f"   engine loop ({role}): steps {r['prompt_steps']:.0f} prompt / {r['decode_steps']:.0f} decode, "
        f"ms a step {f(r['prompt_step_ms'], '.2f')} / {f(r['decode_step_ms'], '.2f')}, on the core "
        f"{f(r['prompt_on_core'], '.2f')} / {f(r['decode_on_core'], '.2f')}, waiting for the device "
        f"{f(r.get('device_wait_ms'), '.2f')} ms a step; steps {r['steps_share']:.2f} of the run; "
        f"CPU engine threads {r['thread_cpu']:.2f}, their processes {r['process_cpu']:.2f}"
        for role, r in rows.items())


def measured_run(url: str, bench_args: argparse.Namespace, report_interval_s: float | None = None) -> dict:
    """One load run with its CPU per process, the mean NIXL READ time (``mean_read_s``), and the server's means
    (``server``: TTFT, end-to-end and a disaggregated request's hand-off as the ingress saw them; queue, prefill and
    decode inside the engines, the hand-off's phases in the decode engine's process), printed as it ends. With
    ``report_interval_s`` (the replicas' metrics period) also the engine loops' figures (``engine_loops``,
    ``loop_deltas``), read a report after the run's start and end (so every step of the run is in, and no other)."""
    from benchmarks.proc_cpu import bench_with_cpu, format_usage
    from serve_app.bench import bench, format_table

    if report_interval_s:
        time.sleep(1.5 * report_interval_s)
        loops = _loops(url)
    before = _histograms(url)
    summary = bench_with_cpu(bench, bench_args)
    after = _histograms(url)
    if report_interval_s:
        time.sleep(1.5 * report_interval_s)
        summary["engine_loops"] = loop_deltas(loops, _loops(url), summary["duration_s"])
    means = {}
    for key in HISTOGRAMS:
        count = after[key][1] - before[key][1]
        means[key] = (after[key][0] - before[key][0]) / count if count else None
    summary["mean_read_s"] = means.pop("read_s")
    summary["server"] = means
    print(format_table([summary]).splitlines()[-2], flush=True)
    if means["ttft_s"] is not None and means["queue_s"] is not None:
        print("   server means ms: " + ", ".join(f"{k[:-2]} {v * 1e3:.2f}" for k, v in means.items() if v is not None)
              + f"; TTFT outside the engine {(means['ttft_s'] - means['queue_s'] - means['prefill_s']) * 1e3:.2f}"
              + (f"; hand-off outside the decode engine's process {(means['handoff_s'] - phases) * 1e3:.2f}"
                 if means["handoff_s"] is not None and (phases := _phase_sum(means)) is not None else ""),
              flush=True)
    print(format_usage(summary["cpu"]), flush=True)
    if summary.get("engine_loops"):
        print(format_loops(summary["engine_loops"]), flush=True)
    return summary


def _phase_sum(means: dict) -> float | None:
    """The mean hand-off phases' sum (the time a take-over spent in the decode engine's process)."""
    phases = [v for k, v in means.items() if k.startswith("handoff_") and k != "handoff_s" and v is not None]
    return sum(phases) if phases else None


def format_paired(p: dict) -> str:
    def ms(v):
        return "-" if v is None else f"{v * 1e3:.2f}"

    ratio = "-" if p["ttft_delta_s"] is None or not p["mean_read_s"] else f"{p['ttft_delta_s'] / p['mean_read_s']:.1f}"
    quartiles = p.get("ttft_delta_quartiles_s")
    spread = f", quartiles {ms(quartiles[0])} / {ms(quartiles[1])}" if quartiles else ""
    return (f"paired, one request at a time ({p['pairs']} prompts, agg and disagg in turn, {p.get('idle_s', 0):g} s "
            f"apart): disagg - agg TTFT {ms(p['ttft_delta_s'])} ms (median{spread}), READ {ms(p['mean_read_s'])} ms, "
            f"ratio {ratio}; first inter-token gap disagg - agg {ms(p['first_gap_delta_s'])} ms (the hand-off's "
            f"stall)")


def _median(values):
    values = sorted(v for v in values if v is not None)
    return values[len(values) // 2] if values else None


def _ratios(summaries: list[dict], offline: list[dict], suffix: str = "") -> str:
    """Medians over the repeats: HTTP output tokens/s against the offline engine, and what disaggregation
    adds to TTFT (p50) against the NIXL READ time (of the apps labelled agg and disagg, plus ``suffix``)."""
    rows = ["| conc | agg HTTP / offline | disagg HTTP / offline | disagg - agg TTFT p50 ms | READ ms | ratio |",
            "|---|---|---|---|---|---|"]
    for c in sorted({o["max_concurrency"] for o in offline}):
        off = _median([o["output_throughput"] for o in offline if o["max_concurrency"] == c])
        runs = {name: [s for s in summaries if s["label"] == name + suffix and s["max_concurrency"] == c]
                for name in ("agg", "disagg")}
        tput = {name: _median([s["output_throughput"] for s in rs]) for name, rs in runs.items()}
        ttft = {name: _median([s["ttft_s"]["p50"] for s in rs]) for name, rs in runs.items()}
        if None in ttft.values():        # one application was not loaded
            rows.append(f"| {c} | " + " | ".join("-" if tput[n] is None else f"{tput[n] / off:.2f}" for n in tput)
                        + " | - | - | - |")
            continue
        delta = (ttft["disagg"] - ttft["agg"]) * 1e3
        read = _median([s.get("mean_read_s") for s in runs["disagg"]])
        rows.append(f"| {c} | {tput['agg'] / off:.2f} | {tput['disagg'] / off:.2f} | {delta:.2f} | "
                    + (f"{read * 1e3:.3f} | {delta / (read * 1e3):.1f} |" if read else "- | - |"))
    return "\n".join(rows)


def paired(urls: dict[str, str], args) -> dict:
    """One request at a time, each prompt to the aggregated then the disaggregated app (the order alternating from
    pair to pair), so that both see the machine in the same state: the median over pairs of what disaggregation adds
    to TTFT and to the first inter-token gap (the hand-off's stall), against the mean READ of those requests. Each
    request starts ``args.paired_idle`` seconds after the one before ended: back to back, on a small machine, a
    request is faster when the one before went to the same application (its processes still running), which
    turns the median by the order of each pair (benchmarks/README.md)."""
    import asyncio

    import httpx

    from serve_app.bench import _one, _prompts, client_session

    ns = _bench_args(urls["agg"], "paired", 1, args)
    ns.num_requests, ns.output_len = args.paired, 8
    idle = getattr(args, "paired_idle", 0.1)
    model = httpx.get(f"{urls['agg']}/v1/models", timeout=30).json()["data"][0]["id"]
    before = _histograms(urls["disagg"])

    async def run() -> list[dict]:
        results = []
        async with client_session(120) as client:
            for i, prompt in enumerate(_prompts(ns)):
                order = ("agg", "disagg") if i % 2 == 0 else ("disagg", "agg")
                pair = {}
                for name in order:
                    await asyncio.sleep(idle)
                    pair[name] = await _one(client, urls[name], model, prompt, ns)
                if all(r.ok and r.itl for r in pair.values()):
                    results.append(pair)
        return results

    pairs = asyncio.run(run())
    after = _histograms(urls["disagg"])
    reads = after["read_s"][1] - before["read_s"][1]
    read = (after["read_s"][0] - before["read_s"][0]) / reads if reads else None
    ttft = sorted(p["disagg"].ttft - p["agg"].ttft for p in pairs)
    gap = sorted(p["disagg"].itl[0] - p["agg"].itl[0] for p in pairs)
    return {"pairs": len(pairs), "ttft_delta_s": ttft[len(ttft) // 2] if ttft else None,
            "ttft_delta_quartiles_s": (ttft[len(ttft) // 4], ttft[3 * len(ttft) // 4]) if ttft else None,
            "first_gap_delta_s": gap[len(gap) // 2] if gap else None, "mean_read_s": read, "idle_s": idle}


def _serve_mode(mode: str) -> dict[str, str]:
    """Set the environment for ``--serve-mode`` before Ray starts (and before Serve is imported: it reads it then)."""
    from serve_app.serve_env import SERVE_ENV, serve_env

    if mode == "default":
        os.environ.update({name: "0" for name in SERVE_ENV})
    return serve_env()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--input-len", type=int, default=32, help="random token-id prompts of this length (no --prompt-file)")
    p.add_argument("--prompt-file", default=None,
                   help="text prompts (JSON lines with 'prompt'), e.g. benchmarks/prompts/heldout.jsonl")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--min-requests", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3, help="runs of every configuration, interleaved; medians reported")
    p.add_argument("--tiny", action="store_true", help="the tiny random pair even if the demo pair exists")
    p.add_argument("--out", default="out/serve_bench")
    p.add_argument("--worker-niceness", type=int, default=0,
                   help="nice value of the Ray workers (Ray's own default is 15); the offline engine runs at 0")
    p.add_argument("--client-processes", type=int, default=1,
                   help="load client processes per run (dflash-serve bench --client-processes)")
    p.add_argument("--paired", type=int, default=64, metavar="N",
                   help="after the load runs, N prompts one at a time to each app in turn: paired TTFT and first-gap "
                        "differences (0: skip)")
    p.add_argument("--paired-idle", type=float, default=0.1, metavar="S",
                   help="seconds between the paired requests (0: back to back)")
    p.add_argument("--serve-mode", choices=["throughput", "default"], default="throughput",
                   help="throughput: Ray Serve's high-throughput mode, as dflash-serve up runs it (SERVE_ENV in "
                        "serve_app/config.py); default: Serve's own defaults (its Python HTTP proxy, Ray calls "
                        "between deployments)")
    p.add_argument("--direct-chunks", nargs="+", choices=["on", "off"], default=["on"],
                   help="the service's direct_chunks, each deployed side by side (apps agg and disagg for on, "
                        "agg-relay and disagg-relay for off) and run in turn")
    args = p.parse_args()
    serving = _serve_mode(args.serve_mode)
    # Read by the raylet this process starts (RayConfig ``worker_niceness``).
    os.environ["RAY_worker_niceness"] = str(args.worker_niceness)

    import ray
    import torch
    from ray import serve

    from serve_app.app import build_app
    from serve_app.bench import format_table, plot, public
    from tests.test_serve_support import free_port, service_args, wait_healthy

    torch.set_num_threads(1)
    target, drafter, pair = _pair(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **serving}})
    summaries = []
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        names = []
        for direct in dict.fromkeys(args.direct_chunks):
            for mode, name in (("aggregated", "agg"), ("disaggregated", "disagg")):
                name += "" if direct == "on" else "-relay"
                # The service's default metrics interval (the tests' 0.2 s reports cost CPU beside the engine).
                app_args = service_args(target, drafter, mode=mode, metrics_report_interval_s=REPORT_INTERVAL_S,
                                        direct_chunks=direct == "on",
                                        model={"num_pages": 256, "max_model_len": 1024,
                                               "max_num_batched_tokens": 512})   # as the offline engine
                serve.run(build_app(app_args), name=name, route_prefix=f"/{name}")
                wait_healthy(f"http://127.0.0.1:{port}/{name}")
                names.append(name)
        for repeat, concurrency in [(r, c) for r in range(args.repeats) for c in args.concurrency]:
            for name in names:
                url = f"http://127.0.0.1:{port}/{name}"
                summaries.append(measured_run(url, _bench_args(url, name, concurrency, args), REPORT_INTERVAL_S))
        pairs = {direct: paired({name: f"http://127.0.0.1:{port}/{name}{'' if direct == 'on' else '-relay'}"
                                 for name in ("agg", "disagg")}, args)
                 for direct in dict.fromkeys(args.direct_chunks)} if args.paired else {}
    finally:
        serve.shutdown()
        ray.shutdown()
    from serve_app.bench import _prompts

    offline = []
    for _, concurrency in [(r, c) for r in range(args.repeats) for c in args.concurrency]:
        prompts = _prompts(_bench_args("", "offline", concurrency, args))
        offline.append(_offline(target, drafter, prompts, concurrency, args.output_len))
    print(f"pair: {pair}; Ray workers at nice {args.worker_niceness}, offline engine at nice {os.nice(0)}; "
          f"Serve mode {args.serve_mode} ({serving})")
    print(format_table(summaries))
    for direct in dict.fromkeys(args.direct_chunks):
        suffix = "" if direct == "on" else "-relay"
        print(f"direct_chunks {direct}:\n{_ratios(summaries, offline, suffix)}")
    for direct, pair_stats in pairs.items():
        print(f"direct_chunks {direct}: {format_paired(pair_stats)}")
    print("| offline | conc | req/s | out tok/s | E2E p50 (batch) ms | AL |\n|---|---|---|---|---|---|")
    for o in offline:
        al = o["mean_acceptance_length"]
        print(f"| offline | {o['max_concurrency']} | {o['request_throughput']:.2f} | {o['output_throughput']:.1f} | "
              f"{o['e2e_p50_s'] * 1000:.1f} | {'-' if al is None else f'{al:.3f}'} |")
    (out / "serve_bench.json").write_text(json.dumps({"pair": pair, "http": [public(s) for s in summaries],
                                                      "offline": offline, "paired": pairs}, indent=1))
    plot(summaries, str(out / "serve_bench.png"))
    print(f"wrote {out / 'serve_bench.json'} and {out / 'serve_bench.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
