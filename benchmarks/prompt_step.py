"""A prefill replica's prompt step against an aggregated replica's, in one engine, side by side.

    PYTHONPATH=. python3 benchmarks/prompt_step.py --device cuda          # the demo pair as disagg_1gpu.yaml runs it
    PYTHONPATH=. .venv/bin/python benchmarks/prompt_step.py --device cpu --prompts 4

The disaggregated service's prefill engine adds each request with ``max_tokens=1`` and ``hold_pages=True`` (its
pages wait for the decode side's READ); the aggregated engine adds it with the client's ``max_tokens``. Both then run
one step that computes the prompt. This runs both kinds in turn in the offline engine of the demo pair (the
single-GPU config's engine settings), one request at a time, each prompt made unique so that no prefix-cache hit
skews a kind, and prints per kind: the prompt step's wall time (median, quartiles), the time to its first token
(the engine's ``first_token_time``, the service's ``prefill`` histogram), and cProfile's top functions by own time
per step. The aggregated request is aborted after its first step (what follows is decoding); the prefill's held
pages are released, as the decode side's READ would have them. A third kind, ``prefix hit``, is the aggregated
request of a prompt the engine has just computed (untimed): its full pages come from the prefix cache, and its step
computes the last page's few tokens (a prompt sent again, the next turn of a chat).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KINDS = ("aggregated", "prefill", "prefix hit")


def prompt_step(engine, ids: list[int], kind: str, params, request_id: str, profile=None) -> tuple[float, float]:
    """One request of ``kind`` through its prompt step (under ``profile`` if given): (step wall seconds, seconds from
    the add to the first token as the engine stamps it)."""
    import dataclasses

    sync = _sync(engine)
    sync()
    added = time.monotonic()
    if kind == "prefix hit":       # the same prompt once before: its full pages are cached, its last few tokens not
        engine.add_request(ids, dataclasses.replace(params, max_tokens=1), request_id + "-first")
        while engine.has_unfinished():
            engine.step()
        sync()
        added = time.monotonic()
    if kind == "prefill":
        engine.add_request(ids, dataclasses.replace(params, max_tokens=1), request_id, hold_pages=True)
    else:
        engine.add_request(ids, params, request_id)
    if profile is not None:
        profile.enable()
    began = time.perf_counter()
    outputs = engine.step()
    wall = time.perf_counter() - began
    if profile is not None:
        profile.disable()
    first = engine.requests[request_id].first_token_time
    assert outputs and outputs[0].new_token_ids, f"{kind}: the prompt step gave no token"
    assert (outputs[0].num_cached_tokens > 0) == (kind == "prefix hit"), (kind, outputs[0].num_cached_tokens)
    if kind == "prefill":
        engine.release(request_id)
    else:
        engine.abort(request_id)
        while engine.has_unfinished():       # a step launched ahead ends with the abort
            engine.step()
    sync()
    return wall, first - added


def _sync(engine):
    import torch

    if engine.model.device.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prompts", type=int, default=24, help="per kind, after 2 warm-up prompts each")
    p.add_argument("--max-tokens", type=int, default=64, help="the aggregated request's")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = p.parse_args()

    import torch

    from benchmarks.gpu_service import _report, demo_llm
    from engine.sequence import SamplingParams

    torch.set_num_threads(1)
    llm = demo_llm(args.device, args.dtype)
    engine = llm.engine
    prompts = [json.loads(line)["prompt"] for line in open(REPO / "benchmarks" / "prompts" / "heldout.jsonl")]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    times = {k: [] for k in KINDS}
    firsts = {k: [] for k in KINDS}
    profiles = {k: cProfile.Profile() for k in KINDS}
    with torch.inference_mode():
        for n in range(args.prompts + 2):
            for kind in (KINDS if n % 2 == 0 else KINDS[::-1]):      # the order alternates
                # Unique from the first token on: no prefix-cache hit.
                ids = llm.tokenizer.encode(f"# {kind} {n}\n" + prompts[n % len(prompts)])[:200]
                warm = n < 2
                wall, first = prompt_step(engine, ids, kind, params, f"{kind}-{n}", None if warm else profiles[kind])
                if not warm:
                    times[kind].append(wall)
                    firsts[kind].append(first)
    result = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
              "dtype": args.dtype, "prompts": args.prompts, "kinds": {}}
    print(f"{result['device']}, demo pair, {args.dtype}, {args.prompts} prompts a kind (up to 200 tokens), "
          f"one at a time, the kinds in turn")
    print("| kind | prompt step ms p50 (p25 / p75) | add to first token ms p50 |")
    print("|---|---|---|")
    for kind in KINDS:
        q = statistics.quantiles(times[kind], n=4)
        result["kinds"][kind] = {"step_ms": [t * 1e3 for t in times[kind]],
                                 "first_ms": [t * 1e3 for t in firsts[kind]],
                                 "profile": _report(profiles[kind], kind, len(times[kind]), 0.0, args.top)}
        print(f"| {kind} | {statistics.median(times[kind]) * 1e3:.2f} ({q[0] * 1e3:.2f} / {q[2] * 1e3:.2f}) | "
              f"{statistics.median(firsts[kind]) * 1e3:.2f} |")
    for kind in KINDS[1:]:
        print(f"{kind} / aggregated (medians): "
              f"{statistics.median(times[kind]) / statistics.median(times['aggregated']):.2f}")
    for kind in KINDS:
        r = result["kinds"][kind]["profile"]
        print(f"\n{kind}: cProfile, own time per prompt step ({r['total_us_per_step']:.0f} us profiled)")
        for t in r["top"]:
            print(f"  {t['us_per_step']:8.1f} us {t['calls_per_step']:7.2f} calls  {t['function']}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
