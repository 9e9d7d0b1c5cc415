"""The engine's device-side step on a GPU, checked in one run (issue 12): lossless speculation and host syncs
per step, on the demo pair.

    python benchmarks/gpu_step_check.py --device cuda          # on the GPU machine (torch only: no Ray, no NIXL)
    python benchmarks/gpu_step_check.py --device cpu           # the same checks here (syncs are not counted)

1. Greedy, float32: the DFlash engine's tokens equal target-only decoding on held-out prompts (plain, and
   with penalties and a logit bias, whose verification counts the drafts on the device).
2. Host syncs per step: a batch mixing greedy, seeded sampled, unseeded top-p and penalised requests, every step
   run under ``torch.cuda.set_sync_debug_mode("warn")``. The engine reads the device once per step (its tokens);
   each further warning is a sync to remove (a pageable host-to-device copy, an ``.item()``, a data-dependent
   shape). Prints the count per step and where the extra ones were raised.
3. Seeded sampling repeats: the same seeded batch twice gives the same tokens.
4. CUDA graphs (issue 12, item 2): every captured graph's replay (ragged ones too) is bit-identical to the eager
   forward of the same padded inputs; a graphed engine (``cuda_graphs: on``) decodes the tokens and per-step AL of
   an eager one (``off``) on the same batch, then on each prompt again alone (a prefix hit: a prompt step of the
   last page's few tokens), float32 and bf16; and the decode steps' mean time, graphed / eager, side by side.
   Off CUDA the graphs' static padded inputs run eagerly (nothing is captured).
5. Overlap (issue 12, item 4), the target alone and with the drafter: with steps launched ahead of the host
   (``overlap: on``) a batch of rows ending at different steps (max_tokens, a stop token; greedy, and a seeded
   sampled row, drafted and rejection-sampled ahead with the drafter; in float32 a penalised one and one asking for
   logprobs),
   together and then arriving one every 3 steps while the others decode, decodes the tokens (and per-step AL, and
   logprobs within 1e-3) of the same engine with ``overlap: off``, in float32 and bf16; steps did launch ahead; the
   syncs the debug mode sees per decode step (the token read waits on an event, which it does not count: expect 0);
   the median decode step of each.
6. No compile while serving: after an engine starts (its ``precompile_kernels``), a closed loop of 16 requests at
   a time (held-out prompts and short ones of 1-33 tokens, 1-48 new tokens each, arriving as others finish)
   makes Triton compile nothing (a compile inside a step stalls every request for 1-2 s), float32 and bf16 with
   an FP8 target cache. Off CUDA nothing is compiled (the interpreter runs the kernels): the check then only runs.
7. Programmatic dependent launch (``engine.triton_attention.PDL``): with each kernel launched while the one before
   it drains, a graphed, overlapped DFlash engine decodes the tokens and per-step AL it decodes with the kernels
   launched one after another, float32 and bf16 with an FP8 target cache; and the median decode step of each. A
   kernel that read its input before the previous kernel had written it would change them. Off sm_90 both runs
   launch serially (the check then only runs).
8. An engine built right after another was dropped, with the garbage collector run at nearly every allocation:
   the dropped engine's graphs must not be freed inside the new engine's captures (no graph may be destroyed while
   a stream captures; ``engine.cuda_graphs.capture_graph``). It decodes the first engine's tokens.
9. Continued requests (``engine.sequence.Continuation``: a stream whose replica was lost goes on elsewhere from
   the output it gave out): a batch of greedy rows (plain, penalised, a stop token held off by min_tokens, one asking
   for logprobs) on the graphed, overlapped DFlash engine, float32, then each cut after a third and two thirds of
   its steps and continued, the cut rows in one batch: each gives the rest of its tokens, text and ending.

Prints a table; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
import traceback
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from engine import SamplingParams  # noqa: E402
from engine.llm import LLM as TargetLLM  # noqa: E402
from spec_decode import LLM  # noqa: E402

DEMO = REPO / "models" / "demo"


def heldout(n: int) -> list[str]:
    lines = (REPO / "benchmarks" / "prompts" / "heldout.jsonl").read_text().splitlines()
    return [json.loads(line)["prompt"] for line in lines[:n]]


def lossless(device: str, prompts: list[str], max_tokens: int) -> list[tuple[str, bool, str]]:
    rows = []
    target = TargetLLM(str(DEMO / "target"), device=device, dtype="float32")
    spec = LLM(str(DEMO / "target"), draft=str(DEMO / "drafter"), device=device, dtype="float32")
    for name, params in (("greedy", SamplingParams(max_tokens=max_tokens, ignore_eos=True)),
                         ("greedy, penalised", SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                              presence_penalty=0.4, logit_bias={13: 1.5}))):
        want = [o.token_ids for o in target.generate(prompts, params)]
        outs = spec.generate(prompts, params)
        got = [o.token_ids for o in outs]
        steps = [al for o in outs for al in o.acceptance_lengths]
        rows.append((f"lossless {name}", got == want, f"mean AL {sum(steps) / max(len(steps), 1):.3f}"))
    return rows


def syncs_per_step(device: str, prompts: list[str], max_tokens: int) -> list[tuple[str, bool, str]]:
    llm = LLM(str(DEMO / "target"), draft=str(DEMO / "drafter"), device=device, dtype="float32")
    engine = llm.engine
    kinds = [SamplingParams(max_tokens=max_tokens, ignore_eos=True),
             SamplingParams(max_tokens=max_tokens, temperature=0.8, top_k=20, seed=3, ignore_eos=True),
             SamplingParams(max_tokens=max_tokens, temperature=1.0, top_p=0.9, ignore_eos=True),
             SamplingParams(max_tokens=max_tokens, presence_penalty=0.5, logit_bias={3: 2.0}, ignore_eos=True)]
    ids = [llm.tokenizer.encode(p) for p in prompts]
    for i, prompt in enumerate(ids):
        engine.add_request(prompt, kinds[i % len(kinds)], request_id=str(i))
    if device != "cuda":
        while engine.has_unfinished():
            engine.step()
        return [("syncs per step", True, "not counted off CUDA")]
    counts, where = [], collections.Counter()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        while engine.has_unfinished():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                engine.step()
            syncs = [w for w in caught if "synchroniz" in str(w.message)]
            counts.append(len(syncs))
            for w in syncs:
                where[f"{Path(w.filename).name}:{w.lineno}"] += 1
    finally:
        torch.cuda.set_sync_debug_mode(0)
    decode_steps = counts[1:]        # the first step prefills (its chunking may differ); every later one decodes
    ok = bool(decode_steps) and max(decode_steps) <= 1
    detail = f"{len(counts)} steps, syncs per step min/max {min(counts)}/{max(counts)}; raised at {dict(where)}"
    return [("syncs per step <= 1", ok, detail)]


def seeded_repeat(device: str, prompts: list[str], max_tokens: int) -> list[tuple[str, bool, str]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.95, seed=11, ignore_eos=True)
    runs = [[o.token_ids for o in LLM(str(DEMO / "target"), draft=str(DEMO / "drafter"), device=device,
                                        dtype="float32").generate(prompts, params)] for _ in range(2)]
    return [("seeded sampling repeats", runs[0] == runs[1], "")]


def graphs_match_eager(device: str, prompts: list[str], max_tokens: int) -> list[tuple[str, bool, str]]:
    rows = []
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    again = SamplingParams(max_tokens=8, ignore_eos=True)
    for dtype in ("float32", "bfloat16"):
        runs = {}
        for mode in ("off", "on"):
            llm = LLM(str(DEMO / "target"), draft=str(DEMO / "drafter"), device=device, dtype=dtype,
                      cuda_graphs=mode if device == "cuda" else "off")
            engine = llm.engine
            if mode == "on" and device != "cuda":
                engine.enable_cuda_graphs(capture=False)
            if mode == "on" and device == "cuda":
                same, total = map(sum, zip(*(graphs.replays_equal_eager() for graphs in engine.graphs)))
                rows.append((f"graph replay == eager {dtype}", same == total, f"{same}/{total} graphs bit-identical"))
            for i, prompt in enumerate(prompts):
                engine.add_request(llm.tokenizer.encode(prompt), params, request_id=str(i))
            done, step_s = {}, []
            while engine.has_unfinished():
                start = time.perf_counter()
                outs = engine.step()             # ends in the step's one host read: the device is done
                step_s.append(time.perf_counter() - start)
                for out in outs:
                    if out.finished:
                        done[out.request_id] = (out.token_ids, out.acceptance_lengths)
            decode = sorted(step_s[1:]) or [float("nan")]
            # Each prompt again, alone: a prefix hit whose last few tokens are one short row (a prompt step).
            for i, prompt in enumerate(prompts):
                engine.add_request(llm.tokenizer.encode(prompt), again, request_id=f"again-{i}")
                while engine.has_unfinished():
                    for out in engine.step():
                        if out.finished:
                            done[out.request_id] = (out.token_ids, out.acceptance_lengths, out.num_cached_tokens)
            runs[mode] = (done, decode[len(decode) // 2], sum(g.steps_run for g in engine.graphs))
        (eager, eager_s, _), (graphed, graphed_s, graphed_steps) = runs["off"], runs["on"]
        hits = sum(d[2] > 0 for r, d in eager.items() if r.startswith("again"))
        rows.append((f"graphed == eager {dtype}", graphed == eager and graphed_steps > 0 and hits == len(prompts),
                     f"median step {graphed_s * 1e3:.2f} ms graphed / {eager_s * 1e3:.2f} ms eager = "
                     f"{graphed_s / eager_s:.2f}x; {graphed_steps} forwards through the graphs; {hits} prompts "
                     f"again with a prefix hit"))
    return rows


def overlap_matches_sync(device: str, prompts: list[str], max_tokens: int) -> list[tuple[str, bool, str]]:
    rows = []
    for dtype in ("float32", "bfloat16"):
        for drafter in (False, True):
            runs = {}
            for mode in ("off", "on"):
                if drafter:
                    llm = LLM(str(DEMO / "target"), draft=str(DEMO / "drafter"), device=device, dtype=dtype,
                              overlap=mode)
                    if device != "cuda":
                        llm.engine.enable_cuda_graphs(capture=False)      # drafting ahead needs the graphs
                else:
                    llm = TargetLLM(str(DEMO / "target"), device=device, dtype=dtype, overlap=mode)
                engine = llm.engine
                ids = [llm.tokenizer.encode(p) for p in prompts]
                if not runs:
                    free = llm.generate(ids[:1], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
                kinds = [SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                         SamplingParams(max_tokens=max_tokens // 2, ignore_eos=True),
                         SamplingParams(max_tokens=max_tokens, stop_token_ids=[free[5]], ignore_eos=True)]
                # Seeded sampled rows: with the drafter their drafts are drawn and rejection-sampled ahead too.
                kinds.append(SamplingParams(max_tokens=max_tokens, temperature=0.8, top_k=20, seed=3, ignore_eos=True))
                if dtype == "float32":
                    # A penalised row (its counts kept on the device for the step launched ahead) and one asking
                    # for logprobs (computed as each step is launched, before the next step's graph replay
                    # overwrites the logits they come from). float32 only: a step launched ahead keeps a row that
                    # has just ended one step longer, so the two engines' batches shrink a step apart, and in bf16
                    # the penalised row's greedy choice flipped at a near-tie once they did (an H100 run: its
                    # 32nd token), which says nothing of the bookkeeping this checks.
                    kinds.append(SamplingParams(max_tokens=max_tokens, presence_penalty=0.8, frequency_penalty=0.4,
                                                logit_bias=((40, 3.0),), ignore_eos=True))
                    kinds.append(SamplingParams(max_tokens=max_tokens, logprobs=2, ignore_eos=True))
                    # A min_tokens row whose stop token every position wants: ahead, its output length counts the
                    # launched step's tokens on the device, so it stops at its 10th token in both engines. float32
                    # only too: its early end shrinks the two engines' batches a step apart, and in bf16 (an H100
                    # run) other rows then drew or chose otherwise at a near-tie (a sampled row's 5th token, a
                    # stop-token row's 48th) while the row itself stopped alike.
                    kinds.append(SamplingParams(max_tokens=max_tokens, min_tokens=9, stop_token_ids=[free[5]],
                                                logit_bias=((free[5], 40.0),)))
                # The batch together, then the same requests arriving one every 3 steps while the others decode
                # (with overlap on, each arrival has the batch read and rescheduled).
                # Every kind at least once (the prompts taken in turn).
                batch = [(ids[i % len(ids)], kinds[i % len(kinds)]) for i in range(max(len(ids), len(kinds)))]
                together = {0: [(prompt, params, str(i)) for i, (prompt, params) in enumerate(batch)]}
                staggered = {3 * i: [(prompt, params, f"late-{i}")] for i, (prompt, params) in enumerate(batch)}
                done, step_s, syncs, logprobs = {}, [], [], {}
                if device == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.set_sync_debug_mode("warn")
                try:
                    for phase, arrivals in enumerate((together, staggered)):
                        step = 0
                        while engine.has_unfinished() or any(s >= step for s in arrivals):
                            for prompt, params, request_id in arrivals.get(step, []):
                                engine.add_request(prompt, params, request_id=request_id)
                            step += 1
                            start = time.perf_counter()
                            with warnings.catch_warnings(record=True) as caught:
                                warnings.simplefilter("always")
                                outs = engine.step()
                            if phase == 0:      # the syncs and times of decode steps: the batch together
                                step_s.append(time.perf_counter() - start)
                                syncs.append(sum("synchroniz" in str(w.message) for w in caught))
                            for out in outs:
                                if out.finished:
                                    done[out.request_id] = (out.token_ids, out.acceptance_lengths)
                                    if out.logprobs:
                                        logprobs[out.request_id] = [e.logprob for e in out.logprobs]
                finally:
                    if device == "cuda":
                        torch.cuda.set_sync_debug_mode(0)
                decode = sorted(step_s[1:]) or [float("nan")]
                runs[mode] = (done, decode[len(decode) // 2], engine.num_overlapped_steps, max(syncs[1:], default=0),
                              logprobs)
            (sync, sync_s, _, _, sync_lp), (over, over_s, ahead, most, over_lp) = runs["off"], runs["on"]
            # Logprobs within float noise (a batch of another size may round a logit's last bit otherwise).
            lp_gap = max((abs(a - b) for k in sync_lp for a, b in zip(sync_lp[k], over_lp.get(k, []))), default=0.0)
            lp_ok = sync_lp.keys() == over_lp.keys() and all(len(sync_lp[k]) == len(over_lp[k]) for k in sync_lp) \
                and (bool(sync_lp) or dtype != "float32") and lp_gap <= 1e-3
            name = f"overlap == sync {'spec ' if drafter else ''}{dtype}"
            # Which requests differ, and at which output token (the kinds are in ``kinds``' order, the rows taking
            # them in turn): what to look at when this fails.
            differ = {k: next((t for t, (a, b) in enumerate(zip(sync[k][0], over.get(k, ([],))[0])) if a != b),
                              min(len(sync[k][0]), len(over.get(k, ([],))[0])))
                      for k in sync if sync[k] != over.get(k)}
            rows.append((name, over == sync and lp_ok and len(over) == 2 * len(batch) and ahead > 0 and most <= 1,
                         f"{ahead} steps launched ahead; syncs per decode step <= {most}; logprobs within "
                         f"{lp_gap:.1e}; median step {over_s * 1e3:.2f} ms overlapped / {sync_s * 1e3:.2f} ms = "
                         f"{over_s / sync_s:.2f}x" + (f"; differ (request: first token): {differ}" if differ else "")))
    return rows


def no_compiles_while_serving(device: str, prompts: list[str], max_tokens: int) -> list[tuple[str, bool, str]]:
    import random

    compiled: list[str] = []
    if device == "cuda":
        import triton

        triton.knobs.runtime.jit_post_compile_hook = lambda *_, **kw: compiled.append(kw.get("repr", "?")[:160])
    rows = []
    try:
        for dtype, kv_dtype in (("float32", "auto"), ("bfloat16", "fp8")):
            start = time.perf_counter()
            llm = LLM(str(DEMO / "target"), draft=str(DEMO / "drafter"), device=device, dtype=dtype,
                      kv_cache_dtype=kv_dtype)
            startup_s = time.perf_counter() - start
            engine, before = llm.engine, len(compiled)
            ids = [llm.tokenizer.encode(p) for p in heldout(32)]
            ids += [ids[0][:n] for n in (1, 2, 3, 5, 9, 17, 33)]
            rng = random.Random(0)
            waiting = [(rng.choice(ids), SamplingParams(max_tokens=rng.choice([1, 5, 17, max_tokens]), ignore_eos=True))
                       for _ in range(96)]
            live = steps = 0
            with torch.inference_mode():
                while waiting or engine.has_unfinished():
                    while live < 16 and waiting:
                        prompt, params = waiting.pop()
                        engine.add_request(prompt, params, request_id=f"r{len(waiting)}")
                        live += 1
                    live -= sum(out.finished for out in engine.step())
                    steps += 1
            new = compiled[before:]
            rows.append((f"no compile serving {dtype}/{kv_dtype}", not new,
                         f"{len(new)} compiles in {steps} steps after a {startup_s:.1f} s start-up"
                         + (f"; first: {new[0]}" if new else "")))
    finally:
        if device == "cuda":
            triton.knobs.runtime.jit_post_compile_hook = None
    return rows


def pdl_matches_serial(device: str, prompts: list[str], max_tokens: int) -> list[tuple[str, bool, str]]:
    from engine import triton_attention

    rows = []
    for dtype, kv_dtype in (("float32", "auto"), ("bfloat16", "fp8")):
        runs = {}
        for pdl in (False, None):
            triton_attention.PDL = pdl
            try:
                llm = LLM(str(DEMO / "target"), draft=str(DEMO / "drafter"), device=device, dtype=dtype,
                          kv_cache_dtype=kv_dtype)
                engine = llm.engine
                if device != "cuda":
                    engine.enable_cuda_graphs(capture=False)
                for i, prompt in enumerate(prompts * 2):
                    engine.add_request(llm.tokenizer.encode(prompt), SamplingParams(max_tokens=max_tokens,
                                                                                    ignore_eos=True),
                                       request_id=str(i))
                done, step_s = {}, []
                while engine.has_unfinished():
                    start = time.perf_counter()
                    for out in engine.step():
                        if out.finished:
                            done[out.request_id] = (out.token_ids, out.acceptance_lengths)
                    step_s.append(time.perf_counter() - start)
                decode = sorted(step_s[1:]) or [float("nan")]
                runs[pdl] = (done, decode[len(decode) // 2], triton_attention.pdl(torch.device(device)))
            finally:
                triton_attention.PDL = None
        (serial, serial_s, _), (dependent, dependent_s, on) = runs[False], runs[None]
        rows.append((f"pdl == serial {dtype}/{kv_dtype}", dependent == serial and len(dependent) == 2 * len(prompts),
                     f"{'launched dependent' if on else 'PDL unavailable here: both serial'}; median step "
                     f"{dependent_s * 1e3:.2f} ms / {serial_s * 1e3:.2f} ms serial = {dependent_s / serial_s:.2f}x"))
    return rows


def rebuild_under_collection(device: str, prompts: list[str], max_tokens: int) -> list[tuple[str, bool, str]]:
    import gc

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    llm = LLM(str(DEMO / "target"), draft=str(DEMO / "drafter"), device=device, dtype="bfloat16")
    first = [(o.token_ids, o.acceptance_lengths) for o in llm.generate(prompts, params)]
    del llm                       # its graphs wait in reference cycles for the collector
    threshold = gc.get_threshold()
    gc.set_threshold(1)
    try:
        llm = LLM(str(DEMO / "target"), draft=str(DEMO / "drafter"), device=device, dtype="bfloat16")
    finally:
        gc.set_threshold(*threshold)
    again = [(o.token_ids, o.acceptance_lengths) for o in llm.generate(prompts, params)]
    graphs = sum(len(g._graphs) for g in llm.engine.graphs) if device == "cuda" else 0
    return [("rebuilt under collection", again == first, f"{graphs} graphs captured with the collector at every "
             f"allocation, after dropping an engine")]


def continuation_matches(device: str, prompts: list[str], max_tokens: int) -> list[tuple[str, bool, str]]:
    from engine.sequence import Continuation

    engine = LLM(str(DEMO / "target"), draft=str(DEMO / "drafter"), device=device, dtype="float32").engine
    ids = [engine.tokenizer.encode(p) for p in prompts]
    kinds = [SamplingParams(max_tokens=max_tokens, ignore_eos=True),
             SamplingParams(max_tokens=max_tokens, ignore_eos=True, presence_penalty=1.5, frequency_penalty=1.0),
             SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=2)]
    requests = {str(i): (p, kinds[i % len(kinds)]) for i, p in enumerate(ids)}

    def run(batch: dict) -> dict:
        """Every output of each request of ``batch`` ({id: (ids, params, continuation)}), stepped to the end."""
        outs = {rid: [] for rid in batch}
        for rid, (prompt, params, given) in batch.items():
            engine.add_request(prompt, params, request_id=rid, continuation=given)
        while engine.has_unfinished():
            for out in engine.step():
                outs[out.request_id].append(out)
        return outs

    def given_out(outs):
        return ([t for o in outs for t in o.new_token_ids], [e for o in outs for e in (o.new_logprobs or ())],
                "".join(o.text_delta for o in outs))

    free = run({rid: (p, params, None) for rid, (p, params) in requests.items()})
    # A stop token each row takes at position k >= 6 for the first time, held off until then by min_tokens.
    stopped = {}
    for rid, (p, params) in requests.items():
        tokens = free[rid][-1].token_ids
        k = next((k for k in range(6, len(tokens)) if tokens[k] not in tokens[:k]), None)
        if k is not None:
            stopped[f"{rid}s"] = (p, SamplingParams(max_tokens=max_tokens, ignore_eos=True, min_tokens=k,
                                                    stop_token_ids=(tokens[k],)))
    requests.update(stopped)
    free.update(run({rid: (p, params, None) for rid, (p, params) in stopped.items()}))
    cut, same, detail = {}, [], []
    for third in (1, 2):
        for rid, (p, params) in requests.items():
            at = max(1, len(free[rid]) * third // 3)
            tokens, logprobs, text = given_out(free[rid][:at])
            cut[f"{rid}.{third}"] = (p, params, Continuation(tokens, logprobs, len(text)))
    went_on = run(cut)
    for key, outs in went_on.items():
        rid = key.split(".")[0]
        before, after = given_out(free[rid][:max(1, len(free[rid]) * int(key[-1]) // 3)]), given_out(outs)
        whole = given_out(free[rid])
        ok = before[0] + after[0] == whole[0] and before[2] + after[2] == whole[2] and \
            outs[-1].finish_reason == free[rid][-1].finish_reason
        same.append(ok)
        if not ok:
            detail.append(f"{key} differs")
    ahead = engine.num_overlapped_steps
    on_gpu = device != "cuda" or ahead > 0        # on CUDA the steps ran ahead of the host (overlap: auto)
    return [("continuation matches", all(same) and on_gpu and engine.kv.pages_in_use() == 0,
             f"{sum(same)}/{len(same)} continued rows equal ({len(stopped)} kinds with a min_tokens stop token), "
             f"{ahead} steps launched ahead; " + "; ".join(detail))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=48)
    checks = (lossless, syncs_per_step, seeded_repeat, graphs_match_eager, overlap_matches_sync,
              no_compiles_while_serving, pdl_matches_serial, rebuild_under_collection, continuation_matches)
    p.add_argument("--checks", nargs="+", default=[c.__name__ for c in checks], choices=[c.__name__ for c in checks])
    args = p.parse_args()
    prompts = heldout(args.prompts)
    rows = []
    for check in (c for c in checks if c.__name__ in args.checks):
        try:
            rows += check(args.device, prompts, args.max_tokens)
        except Exception:
            rows.append((check.__name__, False, traceback.format_exc(limit=3).replace("\n", " | ")))
    print(f"device {args.device} ({torch.cuda.get_device_name() if args.device == 'cuda' else 'host'}), "
          f"torch {torch.__version__}")
    print(f"| {'check':<26} | ok | detail")
    print(f"|{'-' * 28}|----|-------")
    for name, ok, detail in rows:
        print(f"| {name:<26} | {'yes' if ok else 'NO':<3}| {detail}")
    return 0 if all(ok for _, ok, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
