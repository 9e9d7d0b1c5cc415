"""The heterogeneous-TP disaggregation table: mean AL, bytes moved and READ time per request, side by side.

    .venv/bin/python benchmarks/tp_disagg_bench.py [--num-prompts 16] [--max-tokens 48] [--json OUT]

Rows: aggregated TP 1 and 2, disaggregated prefill TP -> decode TP 1->1, 2->2, 2->1, 1->2, each with and without
the draft-layer transfer, over the demo pair (float32, 2 kv heads) on the held-out prompts. Requests run one at a
time, so every step runs the same batch shapes in every row and greedy tokens must match aggregated TP 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from pathlib import Path

import ray

from actors.offline import encode_prompts
from actors.replica import AggregatedReplica, DecodeReplica, PrefillReplica, collect
from engine.llm import EngineConfig
from engine.sequence import SamplingParams

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "models" / "demo"
SPLITS = [(1, 1), (2, 2), (2, 1), (1, 2)]


async def disaggregated_one(prefill, decode, request_id, ids, params):
    """One request through prefill then decode: its output and the transfer stats of its first chunk."""
    ticket = (await prefill.prefill(request_id, ids, params))["ticket"]
    chunks = [chunk async for chunk in decode.decode(ticket)]
    transfer = chunks[0]["transfer"]

    async def replay():
        for chunk in chunks:
            yield chunk

    return await collect(request_id, ids, replay()), transfer


def mean_al(outputs) -> float:
    steps = [al for o in outputs for al in o.acceptance_lengths]
    return round(sum(steps) / len(steps), 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--splits", nargs="+", default=[f"{p}:{d}" for p, d in SPLITS], metavar="P:D",
                        help="prefill TP : decode TP of the disaggregated rows (e.g. 2:4; a TP size above the model's "
                             "kv heads replicates heads)")
    args = parser.parse_args()
    splits = [tuple(int(x) for x in split.split(":")) for split in args.splits]
    lines = (REPO / "benchmarks" / "prompts" / "heldout.jsonl").read_text().splitlines()
    prompts = [json.loads(line)["prompt"] for line in lines if line.strip()][:args.num_prompts]
    prompt_ids = encode_prompts(str(DEMO / "target"), prompts)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    # No prefix cache: every row sends the same prompts again, and a hit would change what a step computes.
    config = EngineConfig(model=str(DEMO / "target"), draft=str(DEMO / "drafter"), num_pages=256,
                          enable_prefix_caching=False)
    ray.init(num_cpus=max(4, 2 * max(max(split) for split in splits)), include_dashboard=False, log_to_driver=False, configure_logging=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}})
    replicas = {}
    rows = []
    try:
        for tp in (1, 2):
            replicas[f"agg{tp}"] = AggregatedReplica(config, tp_size=tp)
        for tp in sorted({p for p, _ in splits}):
            replicas[f"prefill{tp}"] = PrefillReplica(config, tp_size=tp)
        for tp in sorted({d for _, d in splits}):
            for draft in (True, False):
                replicas[f"decode{tp}-{draft}"] = DecodeReplica(config, tp_size=tp, transfer_draft_kv=draft)
        reference = None
        for tp in (1, 2):
            outputs = [asyncio.run(replicas[f"agg{tp}"].generate_all([(f"agg{tp}-{i}", ids, params)]))[0]
                       for i, ids in enumerate(prompt_ids)]
            reference = reference or outputs
            rows.append({"mode": "aggregated", "split": f"TP {tp}", "draft_kv_moved": "-", "mean_al": mean_al(outputs),
                         "tokens_equal_agg_tp1": [o.token_ids for o in outputs] == [o.token_ids for o in reference]})
        for prefill_tp, decode_tp in splits:
            for draft in (True, False):
                tag = f"{prefill_tp}{decode_tp}{'d' if draft else 't'}"
                prefill, decode = replicas[f"prefill{prefill_tp}"], replicas[f"decode{decode_tp}-{draft}"]
                asyncio.run(disaggregated_one(prefill, decode, f"warm-{tag}", prompt_ids[0], params))
                outputs, transfers = [], []
                for i, ids in enumerate(prompt_ids):
                    out, transfer = asyncio.run(disaggregated_one(prefill, decode, f"{tag}-{i}", ids, params))
                    outputs.append(out)
                    transfers.append(transfer)
                rows.append({
                    "mode": "disaggregated", "split": f"{prefill_tp} -> {decode_tp}", "draft_kv_moved": draft,
                    "mean_al": mean_al(outputs),
                    "tokens_equal_agg_tp1": [o.token_ids for o in outputs] == [o.token_ids for o in reference],
                    "per_step_al_equal_agg_tp1": [o.acceptance_lengths for o in outputs]
                    == [o.acceptance_lengths for o in reference],
                    "bytes_per_request": round(statistics.mean(t["bytes"] for t in transfers)),
                    "descriptors_per_request": round(statistics.mean(t["descriptors"] for t in transfers)),
                    "read_ms_median": round(1e3 * statistics.median(t["seconds"] for t in transfers), 3),
                    "lease_check_ms_median": round(1e3 * statistics.median(t["lease_seconds"] for t in transfers), 3),
                })
    finally:
        for replica in replicas.values():
            replica.shutdown()
        ray.shutdown()
    header = ["mode", "split", "draft KV moved", "mean AL", "tokens = agg TP 1", "bytes / request",
              "descriptors / request", "READ ms (median)", "lease check ms (median)"]
    keys = ["mode", "split", "draft_kv_moved", "mean_al", "tokens_equal_agg_tp1", "bytes_per_request",
            "descriptors_per_request", "read_ms_median", "lease_check_ms_median"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(str(row.get(k, "-")) for k in keys) + " |")
    print(json.dumps({"prompts": len(prompts), "max_tokens": args.max_tokens, "rows": rows}))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
