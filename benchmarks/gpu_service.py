"""The disaggregated service on one GPU: Ray actors, pools in GPU memory, NIXL READs over CUDA IPC, real HTTP.

    python benchmarks/gpu_service.py --out out/gpu_service          # on a machine with a GPU, Ray and NIXL

Three parts, in one Ray cluster on the machine, each printing a table (and all of it in ``--out``/result.json):

1. ``pages``: page moves between two KV-manager actors whose pools are in GPU memory and registered with NIXL
   as VRAM, in Qwen3-8B-shaped pools (36 FP8 target layers + 5 BF16 draft layers, 8 kv heads x 128, page 16),
   for the pages of a 2,000-token and a 32k-token prompt, contiguous (one descriptor per pool group) and, for
   the short prompt, scattered (every other page: one descriptor per page and group); each as a NIXL READ and
   as the copy from the reader's CUDA IPC mapping of the source pools (``kv_transport: auto``). Against the
   floor: a device-to-device copy of the same bytes in one process, timed in the same run.
2. ``service``: for each dtype (float32, bfloat16, and bfloat16 with FP8 target KV beside the BF16 draft KV),
   the demo pair deployed three ways on the one GPU
   (``cluster_configs/disagg_1gpu.yaml``'s shares): aggregated, disaggregated (one prefill + one decode
   replica sharing the GPU) and the ablation without the draft-layer transfer. Held-out prompts one at a time
   through HTTP: tokens and per-step acceptance lengths of aggregated and disaggregated must be identical, the
   ablation's AL lower; pages back to 0 everywhere.
3. ``throughput``: the float32 aggregated and disaggregated applications under ``dflash-serve bench`` load
   (held-out prompts, concurrency 1 and 16), then the offline engine on the same GPU and prompts, in batches of
   the concurrency and in a closed loop (a new request as soon as one ends, as the load client sends them): HTTP
   output tokens/s against offline, disaggregated minus aggregated TTFT against the READ time, and the CPU each
   process used under load (``benchmarks/proc_cpu.py``).

``--gpus 2`` runs it on two GPUs of one host, as production places the roles: the page moves go from one GPU to the
other (NIXL over CUDA IPC between the two processes; the floor is a peer copy between the two GPUs in one process),
and the disaggregated application's decode replica has a GPU of its own while its prefill replica shares the other
with the aggregated one (which is idle while the disaggregated one is loaded; the ablation is deployed once the
disaggregated application is gone).

``--device cpu`` runs the same code with pools in shared memory (DRAM) and small sizes: a check of the script.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
# Ray's workers import the project from here (no install needed on a GPU machine with Ray and NIXL).
os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])

CONFIG = REPO / "cluster_configs" / "disagg_1gpu.yaml"


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def copy_floor(nbytes: int, device: str, repeats: int, to_device: str | None = None) -> float:
    """Median seconds of one device-to-device (or host memcpy) copy of ``nbytes``, in this process; ``to_device``:
    into another device (a peer copy between two GPUs)."""
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=to_device or device)
    times = []
    for _ in range(repeats + 1):
        _sync(device)
        _sync(to_device or device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        _sync(to_device or device)
        times.append(time.perf_counter() - t0)
    del src, dst
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return statistics.median(times[1:])


def page_moves(device: str, token_counts: list[int], repeats: int, ucx_env: dict[str, str] | None = None,
               label: str = "defaults", polls: list[float] | None = None, splits: list[int] | None = None,
               ops: list[str] | None = None, gpus: int = 1) -> list[dict]:
    """NIXL READs of a prompt's pages between two KV-manager actors, against a copy of the same bytes.
    ``ucx_env``: UCX variables for both actors on top of the project's (``actors.nixl_transfer``); ``polls``: the
    reader's longest wait between progress calls, each in turn (None: the project's). ``gpus`` 2: each actor on a
    GPU of its own (a whole GPU each, so Ray gives them different ones), against a peer copy."""
    import ray

    from benchmarks.transfer_bench import BenchKVManager
    from kv.pool import KVPool
    from kv.spec import LayerOwner, make_layer_specs

    page_size = 16
    specs = [make_layer_specs(LayerOwner.TARGET, 36, "fp8", 8, 128) + make_layer_specs(LayerOwner.DRAFT, 5, "bf16", 8, 128)]
    most = max(math.ceil(t / page_size) for t in token_counts)
    total_pages = 2 * most
    probe = KVPool(specs[0], page_size, 1, device="meta")
    sizes = [g.page_stride * total_pages for g in probe.groups]
    gpu = device.startswith("cuda")
    managers, infos = [], []
    for name in ("pages-src", "pages-dst"):
        kvm = ray.remote(BenchKVManager).options(
            num_cpus=0, num_gpus=(1 if gpus > 1 else 0.1) if gpu else 0,
            runtime_env={"env_vars": dict(ucx_env or {})}).remote(
            f"{name}-{label}", device=device)
        for n in sizes:
            ray.get(kvm.create_segment.remote(n))
        infos.append(ray.get(kvm.attach.remote(specs, page_size, [total_pages])))
        managers.append(kvm)
    try:
        return _read_rows(managers, infos, probe, device, token_counts, total_pages, page_size, repeats, label,
                          polls or [None], splits or [0], ops or ["READ"], gpu and gpus > 1)
    finally:
        for kvm in managers:
            ray.kill(kvm)


def _read_rows(managers, infos, probe, device, token_counts, total_pages, page_size, repeats, label, polls,
               splits, ops, peer: bool = False) -> list[dict]:
    import ray

    src, dst = managers
    ray.get(src.fill.remote(1))
    agent = ray.get(dst.register_peer.remote(infos[0], src))
    dst_agent = ray.get(src.register_peer.remote(infos[1]))      # for the WRITE rows: src pushes into dst
    if not ray.get(dst.use_mapping.remote(agent, True)):       # host memory: nothing to copy from but NIXL
        ops = [op for op in ops if op != "COPY"]
    rows = []
    for poll, split, tokens in [(p, s, t) for p in polls for s in splits for t in token_counts]:
        if poll is not None:
            ray.get(dst.set_poll.remote(poll))
        ray.get(dst.set_max_descriptor_bytes.remote(split))
        n = math.ceil(tokens / page_size)
        patterns = {"contiguous": (list(range(n)), list(range(total_pages - n, total_pages)))}
        if 2 * n <= total_pages and tokens <= 4096:
            patterns["scattered"] = (list(range(0, 2 * n, 2)), list(range(1, 2 * n, 2)))
        nbytes = n * probe.bytes_per_page
        floor_s = copy_floor(nbytes, "cuda:0" if peer else device, repeats, "cuda:1" if peer else None)
        for (op, pattern), (remote, local) in [((op, k), v) for op in ops for k, v in patterns.items()]:
            ray.get(dst.fill.remote(0))
            seconds, descriptors, splits = [], set(), []
            for i in range(repeats + 1):      # the first READ also maps the peer's memory: not counted
                key = f"{pattern}-{tokens}-{poll}-{split}-{i}"
                if op == "WRITE":
                    stats = ray.get(src.write.remote(dst_agent, [remote], [local]))
                else:
                    ray.get(dst.use_mapping.remote(agent, op == "COPY"))
                    lease = ray.get(src.hold.remote(key, f"lease-{key}", 60.0))
                    stats = ray.get(dst.read.remote(lease, agent, [remote], [local], True, 20.0))
                assert stats["bytes"] == nbytes, stats
                seconds.append(stats["seconds"])
                splits.append(stats.get("split", {}))
                descriptors.add(stats["descriptors"])
            landed = ray.get(dst.region_sum.remote([local])) == nbytes     # every source byte is 1
            hot = None
            if op == "COPY" and device.startswith("cuda"):
                hot = ray.get(dst.time_copies.remote(agent, [remote], [local], 20))
            read_s = statistics.median(seconds[1:])
            rows.append({"op": op, "transport": stats.get("transport", "nixl") + (", GPU to GPU" if peer else ""),
                         "ucx": label, "poll_max_us": None if poll is None else poll * 1e6, "split_MB": split / 2**20,
                         "tokens": tokens,
                         "pattern": pattern, "pages": n, "bytes": nbytes,
                         "descriptors": sorted(descriptors), "bytes_landed": landed,
                         "read_ms": round(read_s * 1e3, 3), "copy_ms": round(floor_s * 1e3, 3),
                         "read_GB_per_s": round(nbytes / read_s / 1e9, 1),
                         "copy_GB_per_s": round(nbytes / floor_s / 1e9, 1),
                         "read_vs_copy": round(floor_s / read_s, 3),
                         "split_ms": {k: round(statistics.median(s.get(k, 0.0) for s in splits[1:]) * 1e3, 3)
                                      for k in ("plan_s", "post_s", "launch_s", "wait_s")},
                         "hot_launch_ms": None if hot is None else round(hot * 1e3, 3)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def gpu_shares(gpus: int) -> dict[str, float]:
    """Each role's replica's share of a GPU. One GPU, five engine replicas (the three applications): 0.2 each (a
    disaggregated replica's KV manager takes 0.1 of it). Two: the decode replica takes a whole GPU, so Ray gives it
    one that no other replica has a share of, and prefill and aggregated replicas share the other (deploy the
    aggregated application first, and the ablation once the disaggregated one is gone)."""
    if gpus > 1:
        return {"aggregated": 0.5, "prefill": 0.5, "decode": 1.0}
    return {"aggregated": 0.2, "prefill": 0.2, "decode": 0.2}


def app_args(mode: str, dtype: str, device: str, gpu_share: float | dict[str, float], **overrides) -> dict:
    """The single-GPU config's application args for one deployment of ``mode``, ``gpu_share`` per replica (or per
    role).
    ``dtype``: the weights' dtype, optionally with the target layers' KV dtype after a colon (``bfloat16:fp8``:
    FP8 target KV beside BF16 draft KV in one pool)."""
    from benchmarks.serve_bench import REPORT_INTERVAL_S
    from serve_app.config import load_config_file

    service, _ = load_config_file(CONFIG)
    args = service.model_dump(mode="json", exclude_none=True)
    args["mode"] = mode
    weights, _, kv = dtype.partition(":")
    args["model"].update(dtype=weights, device=device, kv_cache_dtype=kv or "auto")
    shares = gpu_share if isinstance(gpu_share, dict) else dict.fromkeys(("aggregated", "prefill", "decode"), gpu_share)
    for role in ("aggregated", "prefill", "decode"):
        args[role] = {**args.get(role, {}), "num_replicas": 1, "num_cpus": 1,
                      "num_gpus": shares[role] if device.startswith("cuda") else 0}
    args["metrics_report_interval_s"] = REPORT_INTERVAL_S
    ingresses = overrides.pop("ingress_replicas", None)
    if ingresses is not None:
        args["ingress"] = {**args.get("ingress", {}), "num_replicas": ingresses}
    if "cuda_graphs" in overrides:
        args["model"]["cuda_graphs"] = overrides.pop("cuda_graphs")
    args.update(overrides)
    return args


def deploy(apps: dict[str, dict], port: int, one_by_one: bool = False) -> dict[str, str]:
    """Deploy ``apps`` (all at once, or each healthy before the next: ``gpu_shares``'s placement on two GPUs)."""
    from ray import serve

    from serve_app.app import build_app
    from tests.test_serve_support import wait_healthy

    urls = {name: f"http://127.0.0.1:{port}/{name}" for name in apps}
    for name, args in apps.items():
        serve._run(build_app(args), _blocking=False, name=name, route_prefix=f"/{name}")
        if one_by_one:
            wait_healthy(urls[name], timeout_s=300)
    for url in urls.values():
        wait_healthy(url, timeout_s=300)
    return urls


def heldout(n: int) -> list[str]:
    lines = (REPO / "benchmarks" / "prompts" / "heldout.jsonl").read_text().splitlines()
    return [json.loads(line)["prompt"] for line in lines[:n]]


def served(urls: dict[str, str], prompts: list[str], max_tokens: int) -> dict:
    """Each application's greedy tokens and per-step AL for ``prompts``, one request at a time, then its pages in
    use once they settle and its transfers by transport."""
    from tests.test_serve_support import greedy_completion, wait_pages_free

    results = {name: [greedy_completion(url, p, max_tokens) for p in prompts] for name, url in urls.items()}
    return {"results": results, "pages_in_use_after": dict(zip(urls, wait_pages_free(list(urls.values())))),
            "transfers_by_transport": {name: transports(url) for name, url in urls.items() if name != "agg"}}


def invariants(runs: list[dict]) -> dict:
    """Aggregated vs disaggregated vs the ablation (``served``'s, in one or more runs), one request at a time
    (equal batch shapes)."""
    results = {name: rows for run in runs for name, rows in run["results"].items()}

    def mean_al(rows):
        steps = [al for _, als in rows for al in als]
        return sum(steps) / len(steps)

    agg, disagg, ablate = results["agg"], results["disagg"], results["ablate"]
    return {"tokens_disagg_equal_agg": [t for t, _ in disagg] == [t for t, _ in agg],
            "per_step_al_disagg_equal_agg": [a for _, a in disagg] == [a for _, a in agg],
            "tokens_ablation_equal_agg": [t for t, _ in ablate] == [t for t, _ in agg],
            "mean_al": {name: round(mean_al(rows), 3) for name, rows in results.items()},
            "pages_in_use_after": {k: v for run in runs for k, v in run["pages_in_use_after"].items()},
            "transfers_by_transport": {k: v for run in runs for k, v in run["transfers_by_transport"].items()}}


def transports(url: str) -> dict[str, float]:
    """``dflash_kv_transfers_total`` of one application, per transport label."""
    import httpx

    from tests.test_serve_support import metric_samples, metric_sum

    samples = metric_samples(httpx.get(f"{url}/metrics", timeout=30).text)
    return {t: metric_sum(samples, "dflash_kv_transfers_total", transport=t) for t in ("nixl", "ipc")}


def throughput(urls: dict[str, str], concurrencies: list[int], repeats: int, output_len: int,
               client_processes: int = 1, min_requests: int = 16, profiles: list | None = None) -> list[dict]:
    """Load runs of each application in turn (``repeats`` of each concurrency), after a warm-up; with ``profiles``
    one more run of each at the highest concurrency with every engine process under cProfile (``ProfiledHosts``),
    its reports appended there (that run's figures are not among those returned: the profiler slows it)."""
    from benchmarks.serve_bench import REPORT_INTERVAL_S, _bench_args, measured_run
    from serve_app.bench import bench

    ns = argparse.Namespace(prompt_file=str(REPO / "benchmarks" / "prompts" / "heldout.jsonl"), input_len=64,
                            output_len=output_len, min_requests=min_requests, client_processes=client_processes)
    for concurrency in concurrencies:          # warm-up, not counted: kernels compile for new batch shapes
        for name in urls:
            bench(_bench_args(urls[name], f"{name}-warm-up", concurrency, ns))
    summaries = []
    for _repeat, concurrency in [(r, c) for r in range(repeats) for c in concurrencies]:
        for name in urls:
            summaries.append(measured_run(urls[name], _bench_args(urls[name], name, concurrency, ns),
                                          REPORT_INTERVAL_S))
    if profiles is not None:
        for name in urls:
            with ProfiledHosts() as p:
                bench(_bench_args(urls[name], f"{name}-profiled", max(concurrencies), ns))
            profiles += [{**r, "label": f"{name}: {r['label']}"} for r in p.reports if r["steps"]]
    return summaries


@contextlib.contextmanager
def off_engine_cpus(engine_cpus: list[int] | None):
    """This process (and the load client processes it starts) on the cores the engines do not have, while
    inside."""
    from actors import cpus

    before = os.sched_getaffinity(0)
    rest = before - set(engine_cpus or ())
    if engine_cpus and rest:
        cpus.bind_process(rest)
    try:
        yield
    finally:
        cpus.bind_process(before)


def _engine_hosts() -> list:
    """Every live engine process (rank 0's ``EngineHost`` of each replica)."""
    import ray

    from actors.worker import KV_MANAGER_NAMESPACE

    return [(a["name"], ray.get_actor(a["name"], namespace=KV_MANAGER_NAMESPACE))
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == KV_MANAGER_NAMESPACE and a["name"].endswith("-rank0-worker")]


class ProfiledHosts:
    """cProfile in every engine process over a stretch of load, enabled on its engine thread (from Python 3.12 on a
    profile sees every thread of its process: then its event loop's work is there too), with the time its garbage
    collector ran and its engine loop's steps; ``reports``: the top functions by own time, per step."""

    def __enter__(self):
        import ray

        self.hosts = _engine_hosts()
        ray.get([h.__ray_call__.remote(_start_profile) for _, h in self.hosts])
        return self

    def __exit__(self, *exc):
        import ray

        self.reports = [{**r, "label": name} for (name, _), r in
                        zip(self.hosts, ray.get([h.__ray_call__.remote(_stop_profile) for _, h in self.hosts]))]
        return False


def profiled_closed_loop(llm, prompts, params, concurrency: int) -> dict:
    """``closed_loop`` (staggered) under cProfile in this process: the offline engine's report, as the hosts'."""
    import cProfile
    import gc

    profile, clock = cProfile.Profile(), _GcClock()
    prompts = [llm.tokenizer.encode(p) for p in prompts]        # outside the profile: the engine's work only
    gc.callbacks.append(clock)
    profile.enable()
    try:
        row = closed_loop(llm, prompts, params, concurrency, stagger=True)
    finally:
        profile.disable()
        gc.callbacks.remove(clock)
    return _report(profile, "offline staggered closed loop", row["prefill_steps"] + row["decode_steps"],
                   clock.seconds)


class _GcClock:
    """A ``gc.callbacks`` entry that adds up the time the collector ran (on any thread)."""

    def __init__(self):
        self.seconds, self._began = 0.0, None

    def __call__(self, phase, info):
        if phase == "start":
            self._began = time.perf_counter()
        elif self._began is not None:
            self.seconds += time.perf_counter() - self._began
            self._began = None


def _start_profile(host) -> None:
    import cProfile
    import gc

    host._bench_profile, host._bench_gc = cProfile.Profile(), _GcClock()
    gc.callbacks.append(host._bench_gc)
    # Enabled on the engine thread (before 3.12 a profile sees only the thread that enabled it; from 3.12 on every
    # thread of the process).
    host._bench_steps = host.loop.submit(lambda e: (host._bench_profile.enable(),
                                                    sum(host.loop.stats.steps.values()))[1]).result(timeout=30)


def _stop_profile(host) -> dict:
    import gc

    steps = host.loop.submit(lambda e: (host._bench_profile.disable(),
                                        sum(host.loop.stats.steps.values()))[1]).result(timeout=30) - host._bench_steps
    gc.callbacks.remove(host._bench_gc)
    return _report(host._bench_profile, "engine process", steps, host._bench_gc.seconds)


def _report(profile, label: str, steps: int, gc_s: float, top: int = 30) -> dict:
    """The profile's top functions by own time, in microseconds per engine step."""
    import pstats

    stats = pstats.Stats(profile).stats
    rows = sorted(((tt, cc, f"{Path(f).name}:{line}({name})") for (f, line, name), (cc, _, tt, _, _) in stats.items()),
                  reverse=True)
    per = max(steps, 1)
    return {"label": label, "steps": steps, "gc_us_per_step": gc_s / per * 1e6,
            "total_us_per_step": sum(r[0] for r in rows) / per * 1e6,
            "top": [{"us_per_step": tt / per * 1e6, "calls_per_step": cc / per, "function": fn}
                    for tt, cc, fn in rows[:top]]}


def format_profiles(reports: list[dict]) -> str:
    out = []
    for r in reports:
        if not r["steps"]:
            continue
        out.append(f"{r['label']}: {r['steps']} engine steps, profiled Python {r['total_us_per_step']:.0f} us a step, "
                   f"garbage collection {r['gc_us_per_step']:.0f} us a step")
        out += [f"  {t['us_per_step']:8.1f} us {t['calls_per_step']:7.2f} calls  {t['function']}" for t in r["top"]]
    return "\n".join(out)


def demo_llm(device: str, dtype: str, cuda_graphs: str = "auto"):
    """The offline engine of the demo pair, configured as the single-GPU config's aggregated replica."""
    from spec_decode import LLM

    model = app_args("aggregated", dtype, device, 1.0)["model"]
    return LLM(str(REPO / model["model"]), draft=str(REPO / model["draft"]), device=device, dtype=model["dtype"],
               kv_cache_dtype=model["kv_cache_dtype"], num_pages=model["num_pages"],
               max_model_len=model["max_model_len"], max_num_batched_tokens=model["max_num_batched_tokens"],
               max_num_seqs=model["max_num_seqs"], cuda_graphs=cuda_graphs)


def offline(args, concurrencies: list[int], repeats: int, output_len: int, dtype: str,
            profiles: list | None = None) -> list[dict]:
    """The engine alone on the same GPU: batches of ``concurrency`` held-out prompts through ``LLM.generate``, and
    closed loops (``closed_loop``); the staggered one also with ``cuda_graphs: decode`` (prompt steps eager). With
    ``profiles``, one more staggered loop at the highest concurrency under cProfile, its report appended there."""
    from engine.sequence import SamplingParams

    llm, decode_only = demo_llm(args.device, dtype, "auto"), demo_llm(args.device, dtype, "decode")
    min_requests = getattr(args, "min_requests", 16)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    rows = []
    for _repeat, concurrency in [(r, c) for r in range(repeats) for c in concurrencies]:
        prompts = _prompts_for(concurrency, output_len, min_requests)
        llm.generate(prompts[:1], params)
        _sync(args.device)
        start, tokens = time.perf_counter(), 0
        for i in range(0, len(prompts), concurrency):
            tokens += sum(len(o.token_ids) for o in llm.generate(prompts[i:i + concurrency], params))
        rows.append({"label": "offline", "max_concurrency": concurrency,
                     "output_throughput": tokens / (time.perf_counter() - start)})
        # The staggered loop twice, alternating: prompt steps through the ragged graphs, then eagerly.
        for label, stagger, runner in (("offline-closed-loop", False, llm), ("offline-staggered", True, llm),
                                       ("offline-staggered-decode-graphs", True, decode_only)):
            rows.append({"label": label, "max_concurrency": concurrency,
                         **closed_loop(runner, prompts, params, concurrency, stagger)})
    if profiles is not None:
        prompts = _prompts_for(max(concurrencies), output_len, min_requests)
        profiles.append(profiled_closed_loop(llm, prompts, params, max(concurrencies)))
    return rows


def _prompts_for(concurrency: int, output_len: int, min_requests: int) -> list[str]:
    """The held-out prompts the load client sends at ``concurrency`` (``dflash-serve bench``'s choice)."""
    from benchmarks.serve_bench import _bench_args
    from serve_app.bench import _prompts

    ns = argparse.Namespace(prompt_file=str(REPO / "benchmarks" / "prompts" / "heldout.jsonl"), input_len=64,
                            output_len=output_len, min_requests=min_requests)
    return _prompts(_bench_args("", "offline", concurrency, ns))


def closed_loop(llm, prompts: list[str] | list[list[int]], params, concurrency: int, stagger: bool = False) -> dict:
    """The engine alone fed as the HTTP load client feeds a server: ``concurrency`` requests in flight, the next
    one added as soon as one finishes (the batched offline run above starts each batch of ``concurrency``
    together and runs it to its end, so its rows never change mid-run). Started together, requests of one output
    length stay in step and finish together; ``stagger`` starts them one step apart, as requests arriving over
    HTTP do, so they keep arriving one or two at a time. Returns output tokens/s and the steps' wall times, split
    into those that brought a request's first token (a prompt was computed) and the others. ``prompts``: texts, or
    token ids."""
    import torch

    engine = llm.engine
    waiting = [p if isinstance(p, list) else llm.tokenizer.encode(p) for p in reversed(prompts)]
    live = tokens = 0
    times: dict[str, list[float]] = {"prefill": [], "decode": []}
    start = last = time.perf_counter()
    waited = engine.device_wait_s
    with torch.inference_mode():
        while waiting or engine.has_unfinished():
            admit = 1 if stagger and live < concurrency and tokens == 0 else concurrency - live
            while admit > 0 and waiting:
                engine.add_request(waiting.pop(), params, request_id=f"closed-{len(waiting)}")
                live += 1
                admit -= 1
            outs = engine.step()
            now = time.perf_counter()
            first = any(len(o.token_ids) == len(o.new_token_ids) for o in outs)
            times["prefill" if first else "decode"].append(now - last)
            last = now
            for out in outs:
                if out.finished:
                    live -= 1
                    tokens += len(out.token_ids)
    steps = sum(len(v) for v in times.values())
    row = {"output_throughput": tokens / (time.perf_counter() - start),
           "device_wait_ms": (engine.device_wait_s - waited) / max(steps, 1) * 1e3}
    for kind, values in times.items():
        row[f"{kind}_steps"] = len(values)
        row[f"{kind}_step_ms_p50"] = statistics.median(values) * 1e3 if values else None
        row[f"{kind}_step_s_total"] = sum(values)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--gpus", type=int, default=1, choices=[1, 2],
                   help="GPUs of this host to use: 2 places the two KV managers of the page moves, and the "
                        "disaggregated application's prefill and decode replicas, on different GPUs")
    p.add_argument("--parts", nargs="+", default=["pages", "service", "throughput"],
                   choices=["pages", "service", "throughput"])
    p.add_argument("--tokens", type=int, nargs="+", default=None,
                   help="prompt lengths of the page READs (default 2000 32000 on a GPU, 2000 on CPU)")
    p.add_argument("--ucx", nargs="+", default=None, metavar="LABEL:VAR=VALUE;...",
                   help="page READs once per UCX setting, e.g. ipc:UCX_TLS=cuda_ipc,cuda_copy;UCX_MAX_RNDV_RAILS=1 "
                        "(variables separated by ;); default: the project's settings only")
    p.add_argument("--poll", type=float, nargs="+", default=None,
                   help="the reader's longest wait (s) between progress calls of a READ, each in turn")
    p.add_argument("--split-mb", type=float, nargs="+", default=None,
                   help="cut coalesced regions into descriptors of at most this many MiB, each in turn (0: no cut)")
    p.add_argument("--ops", nargs="+", default=["READ", "COPY"], choices=["READ", "COPY", "WRITE"],
                   help="READ: the decode side pulls with NIXL; COPY: it copies from its CUDA IPC mapping of the "
                        "source pools (what kv_transport auto does on one GPU); WRITE: the source pushes with NIXL")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "bfloat16:fp8"],
                   help="weights dtype[:target KV dtype] of each service check; the first one's apps are timed")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=40)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--output-len", type=int, default=64,
                   help="throughput: tokens each request generates (ignore_eos), HTTP and offline alike")
    p.add_argument("--min-requests", type=int, default=16,
                   help="throughput: requests per run at least (else 2 per stream), HTTP and offline alike")
    p.add_argument("--ingress-replicas", type=int, nargs="+", default=None, metavar="N",
                   help="throughput: with this many ingress replicas, each in turn (default: the config's)")
    p.add_argument("--stream-interval", type=int, nargs="+", default=None, metavar="K",
                   help="throughput: with the replicas streaming every K steps, each in turn (default: the config's)")
    p.add_argument("--direct-chunks", nargs="+", default=None, choices=["on", "off"],
                   help="throughput: with the service's direct_chunks so, each in turn (repeat to alternate: on off "
                        "on off; default: the config's)")
    p.add_argument("--cuda-graphs", nargs="+", default=None, choices=["auto", "on", "decode", "off"],
                   help="throughput: with the engines' cuda_graphs set so, each in turn (default: the config's)")
    p.add_argument("--apps", nargs="+", default=["agg", "disagg"], choices=["agg", "disagg"],
                   help="throughput alone: the applications to load (agg alone needs no NIXL)")
    p.add_argument("--engine-cpus", nargs="+", default=None, metavar="LIST",
                   help="throughput: with the service's engine_cpus so (off, or cores like 0,1,2; the load client "
                        "keeps off them too), each in turn (default: the config's)")
    p.add_argument("--profile", action="store_true",
                   help="throughput: one more run of each application at the highest concurrency with cProfile in "
                        "every engine process, and the offline staggered loop under cProfile (tables per step)")
    p.add_argument("--out", default="out/gpu_service")
    p.add_argument("--serve-mode", choices=["throughput", "default"], default="throughput",
                   help="as in benchmarks/serve_bench.py")
    p.add_argument("--client-processes", type=int, nargs="+", default=None, metavar="N",
                   help="throughput: load client processes per run, each in turn (default 1)")
    p.add_argument("--paired", type=int, default=24, metavar="N",
                   help="throughput: after the load runs, N fresh prompts one at a time to each app in turn "
                        "(as in benchmarks/serve_bench.py; 0: none)")
    p.add_argument("--paired-idle", type=float, default=0.1, metavar="S",
                   help="seconds between the paired requests (0: back to back)")
    args = p.parse_args()
    from benchmarks.serve_bench import _serve_mode

    serving = _serve_mode(args.serve_mode)
    import ray
    import torch
    from ray import serve

    from tests.test_serve_support import free_port

    gpu = args.device.startswith("cuda")
    # Throughput variants: every combination of the settings given (none: the config's).
    variants = [{**({} if i is None else {"ingress_replicas": i}), **({} if k is None else {"stream_interval": k}),
                 **({} if g is None else {"cuda_graphs": g}), **({} if d is None else {"direct_chunks": d == "on"}),
                 **({} if c is None else {"client_processes": c}),
                 **({} if e is None else {"engine_cpus": None if e == "off" else [int(x) for x in e.split(",")]})}
                for i in args.ingress_replicas or [None] for k in args.stream_interval or [None]
                for g in args.cuda_graphs or [None] for d in args.direct_chunks or [None]
                for c in args.client_processes or [None] for e in args.engine_cpus or [None]]
    if gpu and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no GPU visible")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"device": torch.cuda.get_device_name() if gpu else "cpu", "gpus": args.gpus if gpu else 0,
                    "config": str(CONFIG.relative_to(REPO)),
                    "serve_mode": args.serve_mode}
    # Ray starts workers at nice 15; the offline engine runs here at nice 0 (see benchmarks/serve_bench.py).
    os.environ.setdefault("RAY_worker_niceness", "0")
    # Logical CPUs: 3 applications x (ingress + 2 engine replicas) take 1 each, more than a small box has.
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, 12), num_gpus=args.gpus if gpu else 0,
             include_dashboard=False, log_to_driver=True,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **serving}})
    try:
        if "pages" in args.parts:
            tokens = args.tokens or ([2000, 32000] if gpu else [2000])
            result["pages"] = []
            for variant in args.ucx or ["defaults"]:
                label, _, assignments = variant.partition(":")
                env = dict(kv.split("=", 1) for kv in assignments.split(";") if kv)
                try:
                    result["pages"] += page_moves(args.device, tokens, args.repeats, env, label, args.poll,
                                                  [int(mb * 2**20) for mb in args.split_mb or [0]], args.ops,
                                                  args.gpus)
                except Exception as e:       # a UCX setting that cannot READ here: say so, try the next
                    result["pages"].append({"ucx": label, "error": f"{type(e).__name__}: {str(e)[-300:]}"})
                    print(result["pages"][-1], flush=True)
                save(out, result)
        summaries, profiles = [], []
        if "service" in args.parts or "throughput" in args.parts:
            port = free_port()
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            two = gpu and args.gpus > 1
            shares = gpu_shares(args.gpus if gpu else 1)
            for dtype in args.dtypes:
                first = {k: v for k, v in variants[0].items() if k != "client_processes"}
                apps = {"agg": app_args("aggregated", dtype, args.device, shares, **first),
                        "disagg": app_args("disaggregated", dtype, args.device, shares, **first),
                        "ablate": app_args("disaggregated", dtype, args.device, shares, transfer_draft_kv=False)}
                if "service" not in args.parts:     # throughput alone: the applications --apps names
                    apps = {name: apps[name] for name in args.apps}
                # Two GPUs: the ablation's decode replica would want a third; it comes once the disaggregated
                # application is gone.
                later = {"ablate": apps.pop("ablate")} if two and "ablate" in apps else {}
                urls = deploy(apps, port, one_by_one=two)
                runs = [served(urls, heldout(args.num_prompts), args.max_tokens)] if "service" in args.parts else []
                if "throughput" in args.parts and dtype == args.dtypes[0]:
                    for name in set(urls) - set(args.apps):
                        serve.delete(name)
                    urls = {name: urls[name] for name in args.apps}
                    for n, variant in enumerate(variants):
                        if n:        # the same applications again, with this variant's settings
                            for name in args.apps:
                                serve.delete(name)
                            settings = {k: v for k, v in variant.items() if k != "client_processes"}
                            urls = deploy({name: app_args(apps[name]["mode"], dtype, args.device, shares, **settings)
                                           for name in args.apps}, port, one_by_one=two)
                        with off_engine_cpus(variant.get("engine_cpus")):       # the load client too
                            batch = throughput(urls, args.concurrency, args.repeats, args.output_len,
                                               variant.get("client_processes", 1), args.min_requests,
                                               profiles if args.profile and not n else None)
                        for summary in batch:
                            summary["variant"] = variant
                        summaries += batch
                        if args.paired and not n and len(urls) == 2:
                            from benchmarks.serve_bench import format_paired, paired

                            result["paired"] = paired(urls, argparse.Namespace(
                                paired=args.paired, paired_idle=args.paired_idle, prompt_file=None, input_len=64,
                                output_len=8, min_requests=1))
                            print(format_paired(result["paired"]), flush=True)
                if later:
                    if "disagg" in serve.status().applications:
                        serve.delete("disagg")
                    runs.append(served(deploy(later, port), heldout(args.num_prompts), args.max_tokens))
                    urls.update(ablate=f"http://127.0.0.1:{port}/ablate")
                if runs:
                    result.setdefault("service", {})[dtype] = invariants(runs)
                    print(dtype, json.dumps(result["service"][dtype]), flush=True)
                    save(out, result)
                for name in list(urls):
                    if name in serve.status().applications:
                        serve.delete(name)
    finally:
        serve.shutdown()
        ray.shutdown()
    if summaries:
        from benchmarks.serve_bench import _ratios
        from serve_app.bench import format_table, public

        result["throughput"] = {"http": [public(s) for s in summaries],
                                "offline": offline(args, args.concurrency, args.repeats, args.output_len,
                                                   args.dtypes[0],
                                                   profiles if args.profile else None)}
        if profiles:
            result["throughput"]["profiles"] = profiles
        print(format_table(summaries))
        offline_rows = result["throughput"]["offline"]
        tables = []
        for variant in [v for i, v in enumerate(variants) if v not in variants[:i]]:     # a repeated one: its runs
            runs = [s for s in summaries if s["variant"] == variant]
            title = "" if not variant else ", ".join(f"{k} {v}" for k, v in variant.items()) + ":\n"
            tables.append(title + _ratios(runs, [o for o in offline_rows if o["label"] == "offline"]))
        result["throughput"]["table"] = "\n\n".join(tables)
        first_runs = [s for s in summaries if s["variant"] == variants[0]]
        result["throughput"]["closed_loop_table"] = _ratios(
            first_runs, [o for o in offline_rows if o["label"] == "offline-closed-loop"]).replace(
            "HTTP / offline", "HTTP / closed-loop offline")
    save(out, result)
    print_tables(result)
    return 0


def save(out: Path, result: dict) -> None:
    """Written after every part, so a run cut short keeps what it measured."""
    (out / "result.json").write_text(json.dumps(result, indent=1))


def print_tables(result: dict) -> None:
    from actors.nixl_transfer import READ_POLL_MAX_S

    gpus = f" x{result['gpus']}" if result.get("gpus", 1) > 1 else ""
    print(f"\n{result['device']}{gpus}, {result['config']}, Serve mode {result.get('serve_mode')}")
    if result.get("pages"):
        print("\n| op | transport | UCX | poll max us | split MiB | prompt tokens | pages | pattern | MB | descriptors | "
              "move ms | plan / post / launch / wait ms | copy ms | move / copy speed | landed | "
              "launch ms, back to back |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in result["pages"]:
            if "error" in r:
                print(f"| {r['ucx']} | failed: {r['error'][-120:]} |")
                continue
            poll = READ_POLL_MAX_S * 1e6 if r["poll_max_us"] is None else r["poll_max_us"]
            print(f"| {r['op']} | {r.get('transport', 'nixl')} | {r['ucx']} | {poll:g} | {r['split_MB']:g} | {r['tokens']} | {r['pages']} | {r['pattern']} | {r['bytes'] / 1e6:.1f} | "
                  f"{','.join(map(str, r['descriptors']))} | {r['read_ms']} | "
                  f"{' / '.join(str(v) for v in r.get('split_ms', {}).values())} | {r['copy_ms']} | {r['read_vs_copy']} | "
                  f"{r['bytes_landed']} | {r.get('hot_launch_ms')} |")
    for dtype, s in result.get("service", {}).items():
        print(f"\n{dtype}: tokens disagg == agg {s['tokens_disagg_equal_agg']}, per-step AL disagg == agg "
              f"{s['per_step_al_disagg_equal_agg']}, ablation tokens == agg {s['tokens_ablation_equal_agg']}, "
              f"mean AL {s['mean_al']}, pages in use after {s['pages_in_use_after']}, transfers by transport "
              f"{s.get('transfers_by_transport')}")
    if result.get("throughput"):
        print("\n" + result["throughput"]["table"])
        print("\nAgainst the offline engine in a closed loop (fed as the load client feeds the server):\n"
              + result["throughput"].get("closed_loop_table", ""))
        for c in sorted({o["max_concurrency"] for o in result["throughput"]["offline"]}):
            rates = {label: statistics.median(o["output_throughput"] for o in result["throughput"]["offline"]
                                              if o["label"] == label and o["max_concurrency"] == c)
                     for label in ("offline", "offline-closed-loop")}
            print(f"concurrency {c}: offline {rates['offline']:.0f} tok/s batched, "
                  f"{rates['offline-closed-loop']:.0f} in a closed loop "
                  f"({rates['offline-closed-loop'] / rates['offline']:.2f}x)")
            for o in result["throughput"]["offline"]:
                if o["label"].startswith("offline-staggered") and o["max_concurrency"] == c:
                    graphs = "decode-only graphs" if o["label"].endswith("decode-graphs") else "all graphs"
                    print(f"  staggered closed loop, {graphs}: {o['output_throughput']:.0f} tok/s "
                          f"({o['output_throughput'] / rates['offline']:.2f}x batched); steps that computed a prompt: "
                          f"{o['prefill_steps']}, p50 {o['prefill_step_ms_p50']:.2f} ms, "
                          f"{o['prefill_step_s_total']:.2f} s; the others: {o['decode_steps']}, "
                          f"p50 {o['decode_step_ms_p50']:.2f} ms, {o['decode_step_s_total']:.2f} s; waiting for "
                          f"the device {o.get('device_wait_ms', float('nan')):.2f} ms a step")
    if result.get("throughput", {}).get("profiles"):
        print("\nWhere the engine processes' Python time goes (own time per engine step, cProfile):\n"
              + format_profiles(result["throughput"]["profiles"]))
    if result.get("paired"):
        from benchmarks.serve_bench import format_paired

        print("\n" + format_paired(result["paired"]))


if __name__ == "__main__":
    sys.exit(main())
