"""The ``dflash-serve`` command line: offline generation now; the service commands build on it."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from actors.logs import configure_logging

REPO = Path(__file__).resolve().parents[1]
DEMO_TARGET = REPO / "models" / "demo" / "target"
DEMO_DRAFTER = REPO / "models" / "demo" / "drafter"


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="target model directory (default: the bundled demo target)")
    p.add_argument("--draft", default=None, help="DFlash drafter directory (default: the demo drafter with the "
                                                 "demo target)")
    p.add_argument("--no-draft", action="store_true", help="decode with the target alone")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-cache-dtype", default="auto", help="target KV dtype: auto, bf16, fp16, fp32, fp8")
    p.add_argument("--draft-kv-cache-dtype", default="auto", help="draft-layer KV dtype")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--num-pages", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--shared-draft-kv", choices=["auto", "on", "off"], default="auto")
    p.add_argument("--num-spec-tokens", type=int, default=None)
    p.add_argument("--attention-backend", choices=["torch", "triton"], default=None)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """LLM keyword arguments from the parsed engine flags (the demo pair when no model is named)."""
    model = args.model or str(DEMO_TARGET)
    draft = args.draft
    if draft is None and args.model is None and not args.no_draft:
        draft = str(DEMO_DRAFTER)
    if args.no_draft:
        draft = None
    return dict(model=model, draft=draft, device=args.device, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                draft_kv_cache_dtype=args.draft_kv_cache_dtype, page_size=args.page_size, num_pages=args.num_pages,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                shared_draft_kv=args.shared_draft_kv, num_spec_tokens=args.num_spec_tokens,
                attention_backend=args.attention_backend)


def _read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompt_file:
        for number, line in enumerate(Path(args.prompt_file).read_text().splitlines(), 1):
            if not line.strip():
                continue
            if not line.lstrip().startswith("{"):
                prompts.append(line)
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{args.prompt_file}:{number}: a line starting with '{{' must be JSON: {e}") from None
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
                raise ValueError(f"{args.prompt_file}:{number}: a JSON line needs a string 'prompt'")
            prompts.append(record["prompt"])
    if not prompts:
        raise SystemExit("error: give at least one --prompt or a --prompt-file")
    return prompts


def cmd_generate(args: argparse.Namespace) -> int:
    from engine import SamplingParams
    from spec_decode import LLM

    prompts = _read_prompts(args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=tuple(args.stop or ()), ignore_eos=args.ignore_eos)
    if args.mode is not None:
        # The same prompts through Ray replicas: one aggregated, or one prefill and one decode.
        from actors.offline import generate_offline

        kwargs = engine_kwargs(args)
        if args.mode == "agg" and (args.prefill_tp or args.decode_tp):
            raise ValueError("--prefill-tp and --decode-tp need --mode disagg (aggregated: --tp)")
        outputs = generate_offline(args.mode, kwargs, prompts, params, transfer_draft_kv=not args.no_transfer_draft_kv,
                                   tp_size=args.tp, prefill_tp=args.prefill_tp, decode_tp=args.decode_tp)
        speculative = kwargs["draft"] is not None
    else:
        if args.tp != 1 or args.prefill_tp or args.decode_tp:
            raise ValueError("--tp, --prefill-tp and --decode-tp need --mode: tensor-parallel ranks run as Ray actors")
        llm = LLM(**engine_kwargs(args))
        outputs = llm.generate(prompts, params)
        speculative = llm.engine.speculator is not None
    for prompt, out in zip(prompts, outputs):
        if args.json:
            record = {"prompt": prompt, "token_ids": out.token_ids, "text": out.text,
                      "finish_reason": out.finish_reason}
            if speculative:
                record["acceptance_lengths"] = out.acceptance_lengths
                record["mean_acceptance_length"] = out.mean_acceptance_length
            print(json.dumps(record), flush=True)
        else:
            print(prompt + out.text, flush=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash-serve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="offline generation with the engine")
    _engine_args(gen)
    gen.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    gen.add_argument("--prompt-file", help="a file of prompts: one per line, or JSON lines with a 'prompt' field")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="a stop string (repeat for several)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt")
    gen.add_argument("--mode", choices=["agg", "disagg"], default=None,
                     help="run on a local Ray cluster: one aggregated replica, or one prefill and one decode replica")
    gen.add_argument("--tp", type=int, default=1,
                     help="tensor-parallel ranks per replica (with --mode; disagg: both roles unless set below)")
    gen.add_argument("--prefill-tp", type=int, default=None,
                     help="with --mode disagg: tensor-parallel ranks of the prefill replica")
    gen.add_argument("--decode-tp", type=int, default=None,
                     help="with --mode disagg: tensor-parallel ranks of the decode replica (each READs its kv-head "
                          "slices from the prefill ranks holding them)")
    gen.add_argument("--no-transfer-draft-kv", action="store_true",
                     help="with --mode disagg: move target layers only (the ablation: decode drafts from an "
                          "empty drafter context)")
    gen.set_defaults(func=cmd_generate)
    from serve_app.commands import add_service_commands

    add_service_commands(sub, _engine_args)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        configure_logging()
        return args.func(args)
    except (ValueError, FileNotFoundError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
