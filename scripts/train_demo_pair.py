#!/usr/bin/env python3
"""Train the bundled demo pair: a small Qwen3 target on Python stdlib source and a DFlash drafter distilled from it.

    python scripts/train_demo_pair.py --out models/demo [--device cuda|cpu] [--preset demo|smoke]

Writes <out>/target (Hugging Face Qwen3 dir), <out>/drafter (z-lab DFlash dir), <out>/train.log and
<out>/metrics.json, and the held-out prompts to --prompts. Side modes: --eval-only re-measures acceptance of a
trained pair, --time-steps projects the preset's cost on a device from a few timed steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import sysconfig
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # runnable from a checkout without installing

from spec_decode import training as T  # noqa: E402
from spec_decode.drafter import DFlashDrafter  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when available")
    parser.add_argument("--preset", choices=sorted(T.PRESETS), default="demo")
    parser.add_argument("--corpus", type=Path, default=Path(".corpus/stdlib.jsonl.xz"),
                        help="read if present, else built from this interpreter's stdlib and written here")
    parser.add_argument("--prompts", type=Path, default=None,
                        help="where the held-out prompts go (default <out>/heldout.jsonl)")
    parser.add_argument("--target-from", type=Path, default=None,
                        help="reuse a trained target dir (and its tokenizer) and train only the drafter")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="override a preset field, e.g. --set drafter_time_budget_s=30 (repeatable)")
    parser.add_argument("--eval-only", action="store_true",
                        help="only measure acceptance of the pair already in <out> on the --prompts file")
    parser.add_argument("--time-steps", type=int, default=0,
                        help="only time this many training steps of each model on --device and project the preset")
    return parser.parse_args()


def apply_overrides(preset: T.Preset, overrides: list[str]) -> T.Preset:
    changes = {}
    for item in overrides:
        field, _, value = item.partition("=")
        current = getattr(preset, field)      # AttributeError names an unknown field
        changes[field] = tuple(int(v) for v in value.split(",")) if isinstance(current, tuple) else type(current)(value)
    return dataclasses.replace(preset, **changes)


def load_or_build_corpus(path: Path, log) -> list[dict]:
    if path.exists():
        records = T.load_corpus(path)
        log(f"corpus: {len(records)} files from {path}")
    else:
        stdlib = sysconfig.get_paths()["stdlib"]
        records = T.build_corpus(stdlib)
        T.save_corpus(records, path)
        log(f"corpus: {len(records)} files from {stdlib}, saved to {path}")
    return records


def time_steps(preset: T.Preset, device: torch.device, steps: int, log) -> None:
    """Per-step cost of the preset's target and drafter steps on random tokens, projected to the full preset.

    On CPU a full-size step does not fit in memory, so it times 1/16 of the batch and scales up (CPU time is
    linear in the batch)."""
    vocab = preset.vocab_size
    scale = 16 if device.type == "cpu" else 1
    gen = torch.Generator(device=device).manual_seed(0)
    target = T.make_target(preset, vocab, eos_id=0).to(device)
    optimizer = T.make_adamw(target, preset.lr, device)
    windows = torch.randint(4, vocab, (preset.batch_size // scale, preset.seq_len + 1), generator=gen, device=device)
    seconds = []
    for _ in range(steps + 1):                      # the first step pays one-time setup
        start = time.perf_counter()
        T.target_train_step(target, optimizer, windows, device).item()
        seconds.append(time.perf_counter() - start)
    target_step = scale * sum(seconds[1:]) / steps
    log(f"target: {target_step:.2f}s/step x {preset.max_steps} steps = {target_step * preset.max_steps / 60:.0f} min")

    target.eval()
    prompts = torch.randint(4, vocab, (8, 64), generator=gen, device=device)
    start = time.perf_counter()
    T.greedy_continue(target, prompts, 32, device)
    gen_token = (time.perf_counter() - start) / (8 * 32)
    generated = preset.distill_max_sequences * (preset.distill_seq_len - min(preset.distill_prompt_lens))
    log(f"distill generation: {gen_token * 1e3:.2f}ms/token x {generated / 1e6:.1f}M tokens (at most) "
        f"= {gen_token * generated / 60:.0f} min")

    drafter = DFlashDrafter.initialized(T.drafter_config(preset, vocab, mask_token_id=1)).to(device)
    optimizer = T.make_adamw(drafter, preset.drafter_lr, device)
    rows = preset.drafter_batch // scale
    sequences = torch.randint(4, vocab, (rows, preset.distill_seq_len), generator=gen, device=device)
    prompt_lens = torch.full((rows,), min(preset.distill_prompt_lens), device=device)
    seconds = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        loss, _ = T.drafter_loss(drafter, target, sequences, prompt_lens, preset.anchors_per_seq, device, gen)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss.item()
        seconds.append(time.perf_counter() - start)
    drafter_step = scale * sum(seconds[1:]) / steps
    log(f"drafter: {drafter_step:.2f}s/step x {preset.drafter_max_steps} steps "
        f"= {drafter_step * preset.drafter_max_steps / 60:.0f} min")


def evaluate_saved(args: argparse.Namespace, preset: T.Preset, device: torch.device, log) -> None:
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(str(args.out / "target" / "tokenizer.json"))
    prompts_path = args.prompts or args.out / "heldout.jsonl"
    prompts = [json.loads(line)["prompt"] for line in prompts_path.read_text().splitlines()]
    target = T.load_target(args.out / "target", device)
    drafter = DFlashDrafter.from_pretrained(args.out / "drafter", device=device)
    prompt_ids = [tokenizer.encode(p, add_special_tokens=False).ids for p in prompts[:preset.num_eval_prompts]]
    acceptance = T.evaluate_acceptance(target, drafter, prompt_ids, preset.eval_new_tokens, log)
    log(f"acceptance: {json.dumps(acceptance)}")


def main() -> None:
    args = parse_args()
    preset = apply_overrides(T.PRESETS[args.preset], args.set)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(0)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    args.out.mkdir(parents=True, exist_ok=True)
    # The side modes log beside a trained pair without overwriting its train.log.
    log_name = "eval.log" if args.eval_only else "timing.log" if args.time_steps else "train.log"
    log = T.RunLog(args.out / log_name)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu x{torch.get_num_threads()}"
    if args.set:
        log(f"preset overrides: {args.set}")
    log(f"preset {preset.name} on {where}; torch {torch.__version__}, python {sys.version.split()[0]}")
    if args.time_steps:
        time_steps(preset, device, args.time_steps, log)
        return
    if args.eval_only:
        evaluate_saved(args, preset, device, log)
        return
    metrics: dict = {"preset": preset.name, "device": where}
    run_start = time.perf_counter()

    records = load_or_build_corpus(args.corpus, log)
    train_docs, heldout_docs = T.split_corpus(records, preset.max_train_chars)
    log(f"split: {len(train_docs)} train files ({sum(len(r['text']) for r in train_docs) / 1e6:.1f}M chars), "
        f"{len(heldout_docs)} held-out files ({sum(len(r['text']) for r in heldout_docs) / 1e6:.2f}M chars) "
        f"from modules {sorted(T.HELDOUT_MODULES)}")

    if args.target_from is not None:
        from tokenizers import Tokenizer
        tokenizer = Tokenizer.from_file(str(args.target_from / "tokenizer.json"))
        log(f"tokenizer: reused from {args.target_from}")
    else:
        start = time.perf_counter()
        tokenizer = T.train_tokenizer([r["text"] for r in train_docs], preset.vocab_size)
        log(f"tokenizer: {tokenizer.get_vocab_size()} tokens in {time.perf_counter() - start:.1f}s")

    prompts = T.make_heldout_prompts(heldout_docs, tokenizer)
    prompts_path = args.prompts or args.out / "heldout.jsonl"
    prompts_path.parent.mkdir(parents=True, exist_ok=True)
    prompts_path.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    log(f"held-out prompts: {len(prompts)} written to {prompts_path}")

    train_ids = T.encode_documents(tokenizer, [r["text"] for r in train_docs]).to(device)
    heldout_ids = T.encode_documents(tokenizer, [r["text"] for r in heldout_docs]).to(device)
    chars = sum(len(r["text"]) for r in train_docs)
    log(f"tokens: {train_ids.numel() / 1e6:.2f}M train ({chars / train_ids.numel():.2f} chars/token), "
        f"{heldout_ids.numel() / 1e6:.3f}M held-out")
    metrics["corpus"] = {"train_files": len(train_docs), "heldout_files": len(heldout_docs),
                         "train_tokens": train_ids.numel(), "heldout_tokens": heldout_ids.numel(),
                         "chars_per_token": round(chars / train_ids.numel(), 3)}

    target_dir = args.out / "target"
    if args.target_from is not None:
        if args.target_from.resolve() != target_dir.resolve():
            shutil.copytree(args.target_from, target_dir, dirs_exist_ok=True)
    else:
        eos_id = tokenizer.token_to_id(T.EOS_TOKEN)
        model = T.make_target(preset, tokenizer.get_vocab_size(), eos_id).to(device)
        log(f"target: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
        metrics["target"] = T.train_target(model, train_ids, heldout_ids, preset, device, log)
        T.save_target(model, tokenizer, target_dir)
        del model
    # Everything downstream uses the saved bf16 weights, which are what the engine serves.
    target = T.load_target(target_dir, device)
    saved_loss = T.mean_token_loss(target, heldout_ids, preset.seq_len, preset.batch_size, device, preset.eval_windows)
    metrics.setdefault("target", {})["saved_heldout_loss"] = round(saved_loss, 4)
    log(f"saved target: held-out loss {saved_loss:.4f}")

    sequences, prompt_lens = T.build_distill_set(target, train_ids, preset, device, log)
    config = T.drafter_config(preset, tokenizer.get_vocab_size(), tokenizer.token_to_id(T.MASK_TOKEN))
    drafter = DFlashDrafter.initialized(config).to(device)
    log(f"drafter: {sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M parameters, block {config.block_size}, "
        f"target layers {list(config.target_layer_ids)}")
    metrics["drafter"] = T.train_drafter(drafter, target, sequences, prompt_lens, preset, device, log)
    metrics["drafter"]["distill_sequences"] = sequences.shape[0]
    drafter.save_pretrained(args.out / "drafter")
    del drafter, sequences

    # Evaluate the checkpoints as saved, in true fp32 (no TF32), on prompts the target never trained on.
    torch.backends.cuda.matmul.allow_tf32 = False
    drafter = DFlashDrafter.from_pretrained(args.out / "drafter", device=device)
    prompt_ids = [tokenizer.encode(p["prompt"], add_special_tokens=False).ids
                  for p in prompts[:preset.num_eval_prompts]]
    metrics["acceptance"] = T.evaluate_acceptance(target, drafter, prompt_ids, preset.eval_new_tokens, log)
    metrics["seconds_total"] = round(time.perf_counter() - run_start, 1)
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    log(f"done in {metrics['seconds_total']}s: {json.dumps({k: v for k, v in metrics.items() if k != 'target'})}")


if __name__ == "__main__":
    main()
