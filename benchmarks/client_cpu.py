"""The load client's own CPU per streamed event (``dflash-serve bench``'s ``_run``), this tree's against another
tree's (``--baseline``), taking turns against one running server. A client beside the server on one host takes
cores the engines could use, so its cost is part of what ``serve_bench.py`` and ``gpu_service.py`` measure.

    scripts/serve &                                       # or any OpenAI-compatible server
    git archive <commit> | tar -x -C .old                 # the tree to compare with
    PYTHONPATH=. .venv/bin/python benchmarks/client_cpu.py --baseline .old --rounds 3

Reported per run: events (SSE events carrying text, the usage event included), the client process's CPU time
(user + system) per event, output tokens/s, and the cores the client used.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import resource
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _load(tree: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, tree / "serve_app" / "bench.py")
    module = sys.modules[name] = importlib.util.module_from_spec(spec)      # (its dataclasses look it up)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    from serve_app import bench

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--baseline", type=Path, default=None, help="a tree whose serve_app/bench.py runs in turn")
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()

    import httpx

    ns = argparse.Namespace(url=args.url, num_requests=args.num_requests, max_concurrency=args.concurrency,
                            input_len=args.input_len, output_len=args.output_len, prompt_file=None, temperature=0.0,
                            seed=0, request_rate=float("inf"), arrival="poisson", no_progress=True, label=None)
    model = httpx.get(f"{args.url}/v1/models", timeout=30).json()["data"][0]["id"]
    prompts = bench._prompts(ns)
    clients = [("this tree", bench)]
    if args.baseline is not None:
        clients.insert(0, (f"baseline ({args.baseline})", _load(args.baseline.resolve(), "baseline_bench")))
    asyncio.run(clients[-1][1]._run(ns, model, prompts[:args.concurrency]))       # connections and imports warm
    print("| round | client | ok | events | CPU us / event | out tok/s | client cores |\n|---|---|---|---|---|---|---|")
    for round_ in range(args.rounds):
        for name, module in clients:
            cpu = _cpu_s()
            results, duration = asyncio.run(module._run(ns, model, prompts))
            cpu = _cpu_s() - cpu
            ok = [r for r in results if r.ok]
            events = sum(len(r.itl) + 1 for r in ok) + len(ok)       # text events (first + gaps) and the usage one
            tokens = sum(r.output_tokens for r in ok)
            print(f"| {round_} | {name} | {len(ok)}/{len(results)} | {events} | {cpu / events * 1e6:.0f} | "
                  f"{tokens / duration:.0f} | {cpu / duration:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
