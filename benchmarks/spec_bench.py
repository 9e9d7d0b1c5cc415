"""Speculative decoding speed: the same prompts with and without the DFlash drafter, in one run.

CPU, demo pair:   python benchmarks/spec_bench.py
GPU, random 8B-shaped target + 5-layer random drafter (speed and the per-step phase split only):
                  python benchmarks/spec_bench.py --preset qwen3-8b --device cuda

Reports decode tokens/s for both, the speedup, the mean acceptance length (AL) and speedup / AL (how
much of the ideal the step overheads leave), and the with-drafter step time split into draft,
target (verify) and bookkeeping. With ``--repeats N`` the two engines take turns N times and each figure is
the median pass (the speedup: the median of the N side-by-side ratios), so one pass disturbed by the machine
does not decide it.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def _generate(engine, prompts, params, batch):
    """``params``: one ``SamplingParams`` for every prompt, or one per prompt."""
    outputs = []
    per_prompt = params if isinstance(params, list) else [params] * len(prompts)
    t = time.perf_counter()
    for i in range(0, len(prompts), batch):
        reqs = [engine.add_request(p, sp) for p, sp in zip(prompts[i:i + batch], per_prompt[i:i + batch])]
        while engine.has_unfinished():
            engine.step()
        outputs.extend(reqs)
    return outputs, time.perf_counter() - t


def sampling(max_tokens: int, count: int, temperature: float = 0.0, presence_penalty: float = 0.0) -> list:
    """Greedy parameters for ``count`` prompts, or (``temperature`` > 0) seeded sampled ones, prompt i with seed i:
    two engines that draw alike give the same tokens; with ``presence_penalty``, penalised."""
    from engine import SamplingParams

    if temperature <= 0:
        return [SamplingParams(max_tokens=max_tokens, presence_penalty=presence_penalty, ignore_eos=True)] * count
    return [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i, presence_penalty=presence_penalty,
                           ignore_eos=True) for i in range(count)]


def run(engine, prompts, max_tokens, batch, phases=True, temperature=0.0, presence_penalty=0.0):
    """Tokens/s of the prompts in batches of ``batch``; then, with ``phases``, the same again with the step's
    phases timed (each phase ends in a device sync, so that pass is slower and only gives the split)."""
    params = sampling(max_tokens, len(prompts), temperature, presence_penalty)
    outputs, elapsed = _generate(engine, prompts, params, batch)
    if phases:
        engine.phase_seconds = dict.fromkeys(engine.phase_seconds, 0.0)
        engine.time_phases = True
        _generate(engine, prompts, params, batch)
        engine.time_phases = False
    tokens = sum(len(r.output_token_ids) for r in outputs)
    drafts = sum(r.spec.num_drafts for r in outputs)
    accepted = sum(r.spec.num_accepted_tokens for r in outputs)
    return dict(tokens_per_s=tokens / elapsed, seconds=elapsed, tokens=tokens,
                mean_al=(1 + accepted / drafts) if drafts else None,
                phases=dict(engine.phase_seconds), outputs=[r.output_token_ids for r in outputs])


def overlap_ab(args, engine, prompts) -> None:
    """The with-drafter engine synchronous and overlapped, taking turns ``args.repeats`` times (medians), on the same
    requests; seeded requests must decode the same tokens both ways."""
    if engine.model.device.type != "cuda":       # a check of the script: the graphs' static inputs run eagerly
        engine.enable_cuda_graphs(capture=False)
    # Every pass sends the same prompts: a prefix hit would change what a prefill computes (other kernels, other
    # last bits), and a sampled row's draws with it.
    engine.kv.enable_prefix_caching = False
    modes = {"synchronous": False, "overlapped": True}

    def timed(overlapped: bool, count: int, max_tokens: int) -> dict:
        engine.overlap, before = overlapped, engine.num_overlapped_steps
        try:
            result = run(engine, prompts[:count], max_tokens, args.batch, phases=False, temperature=args.temperature,
                         presence_penalty=args.presence_penalty)
        finally:
            engine.overlap = True
        return {**result, "steps_ahead": engine.num_overlapped_steps - before}

    for overlapped in modes.values():                            # warm-up
        timed(overlapped, 2, 8)
    passes = [{name: timed(overlapped, len(prompts), args.max_tokens) for name, overlapped in modes.items()}
              for _ in range(args.repeats)]
    ratios = sorted(p["overlapped"]["tokens_per_s"] / p["synchronous"]["tokens_per_s"] for p in passes)
    same = all(p["overlapped"]["outputs"] == p["synchronous"]["outputs"] for p in passes)
    kind = ("greedy" if args.temperature <= 0 else f"seeded, temperature {args.temperature:g}") + \
        (f", presence penalty {args.presence_penalty:g}" if args.presence_penalty else "")
    which = f"pair {args.pair}" if args.preset == "demo" else f"preset {args.preset}"
    print(f"{which} device {args.device} batch {args.batch}: {len(prompts)} prompts x "
          f"{args.max_tokens} tokens ({kind}), with the drafter; tokens identical both ways: {same}")
    for name in modes:
        best = sorted(p[name]["tokens_per_s"] for p in passes)
        al = passes[0][name]["mean_al"]
        print(f"{name:12s} {best[len(best) // 2]:9.1f} tok/s   mean AL {al:.2f}   steps launched ahead "
              f"{passes[0][name]['steps_ahead']}   (passes: "
              + ", ".join(f"{t:.1f}" for t in best) + ")")
    print(f"overlapped / synchronous {ratios[len(ratios) // 2]:.2f}x (per pass, sorted: "
          + ", ".join(f"{r:.2f}" for r in ratios) + ")")
    if args.json:
        Path(args.json).write_text(json.dumps({"ratios": ratios, "tokens_identical": same, "passes": [
            {name: {k: v for k, v in r.items() if k != "outputs"} for name, r in p.items()} for p in passes]},
            indent=1))


def pair_engines(args):
    """The trained pair in ``args.pair`` (``target/``, ``drafter/``), alone and with its drafter, and the held-out
    prompts in its tokens."""
    from spec_decode import LLM

    common = dict(page_size=16, max_num_batched_tokens=1024, device=args.device, dtype=args.dtype or "float32",
                  kv_cache_dtype=args.kv_cache_dtype, kv_cache_bytes=args.kv_cache_mib * 2**20)
    base = LLM(args.pair / "target", **common).engine
    spec = LLM(args.pair / "target", draft=args.pair / "drafter", **common).engine
    prompts_file = REPO / "benchmarks/prompts/heldout.jsonl"
    texts = [json.loads(line)["prompt"] for line in prompts_file.read_text().splitlines() if line.strip()]
    prompts = [base.tokenizer.encode(t) for t in texts[:args.num_prompts]]
    return base, spec, prompts


def random_engines(args, preset: dict | None = None, kv_cache_bytes: int = 8 * 2**30,
                   max_num_batched_tokens: int = 4096, n_draft: int = 5):
    """A random target of ``preset`` (else ``args.preset``'s) alone and with a random ``n_draft``-layer drafter,
    sharing the target's weights, and ``args.num_prompts`` random 512-token prompts."""
    from benchmarks.engine_bench import PRESETS, make_hf
    from engine.checkpoint import Qwen3Config
    from engine.llm import EngineConfig
    from engine.model import Qwen3Model
    from spec_decode import build_engine_from_model
    from spec_decode.drafter import DFlashConfig, DFlashDrafter, default_target_layer_ids

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or "bfloat16")
    preset = preset or PRESETS[args.preset]
    hf = make_hf(preset, dtype, device)
    cfg = Qwen3Config.from_dict({**preset, "rms_norm_eps": 1e-6, "rope_theta": 1e6})
    target = Qwen3Model(cfg, dict(hf.state_dict()), device, dtype, "random")
    del hf
    h, hd, nq, nkv, inter = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, \
        cfg.intermediate_size
    layer_ids = default_target_layer_ids(cfg.num_hidden_layers, n_draft)
    dcfg = DFlashConfig(hidden_size=h, intermediate_size=inter, num_hidden_layers=n_draft, num_attention_heads=nq,
                        num_key_value_heads=nkv, head_dim=hd, rms_norm_eps=1e-6, rope_theta=1e6,
                        vocab_size=cfg.vocab_size, block_size=args.block_size, mask_token_id=cfg.vocab_size - 1,
                        target_layer_ids=tuple(layer_ids), num_target_layers=cfg.num_hidden_layers)

    def rand(*shape):
        return torch.randn(*shape, device=device, dtype=dtype) * 0.02

    tensors = {"fc.weight": rand(h, len(layer_ids) * h), "hidden_norm.weight": torch.ones(h, device=device, dtype=dtype),
               "norm.weight": torch.ones(h, device=device, dtype=dtype)}
    for i in range(n_draft):
        p = f"layers.{i}."
        tensors.update({p + "self_attn.q_proj.weight": rand(nq * hd, h), p + "self_attn.k_proj.weight": rand(nkv * hd, h),
                        p + "self_attn.v_proj.weight": rand(nkv * hd, h), p + "self_attn.o_proj.weight": rand(h, nq * hd),
                        p + "self_attn.q_norm.weight": torch.ones(hd, device=device, dtype=dtype),
                        p + "self_attn.k_norm.weight": torch.ones(hd, device=device, dtype=dtype),
                        p + "mlp.gate_proj.weight": rand(inter, h), p + "mlp.up_proj.weight": rand(inter, h),
                        p + "mlp.down_proj.weight": rand(h, inter),
                        p + "input_layernorm.weight": torch.ones(h, device=device, dtype=dtype),
                        p + "post_attention_layernorm.weight": torch.ones(h, device=device, dtype=dtype)})
    drafter = DFlashDrafter(dcfg, tensors, "random", max_positions=target.rope.max_positions)
    config = EngineConfig(model="random", device=args.device, dtype=str(dtype).removeprefix("torch."),
                          kv_cache_bytes=kv_cache_bytes, max_num_batched_tokens=max_num_batched_tokens,
                          kv_cache_dtype=args.kv_cache_dtype)
    base = build_engine_from_model(target, config)
    spec = build_engine_from_model(target, config, drafter=drafter)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, cfg.vocab_size - 1, (args.num_prompts, 512), generator=g).tolist()
    return base, spec, prompts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", choices=["demo", "tiny", "qwen3-8b"], default="demo",
                    help="demo: a trained pair (--pair); tiny, qwen3-8b: random weights (speed only)")
    ap.add_argument("--pair", type=Path, default=REPO / "models/demo",
                    help="the trained pair's folder, with target/ and drafter/ (scripts/train_demo_pair.py --out)")
    ap.add_argument("--kv-cache-mib", type=int, default=256, help="the trained pair's KV pool")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=16, help="random drafter's block size (qwen3-8b preset)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1, help="passes of each engine, taking turns (medians)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--linears", choices=["triton", "torch", "fused", "unfused"], default="triton",
                    help="torch: every linear on cuBLAS, without the few-row Triton kernel (triton_ops.linear); "
                         "fused / unfused: that kernel with or without the layers' norms, residual adds and SwiGLU "
                         "folded in (triton: the engine's default, triton_ops.FUSED_LAYERS)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="> 0: seeded sampled requests (prompt i with seed i) instead of greedy ones")
    ap.add_argument("--presence-penalty", type=float, default=0.0, help="penalised requests (--overlap-ab)")
    ap.add_argument("--overlap-ab", action="store_true",
                    help="compare the with-drafter engine with its steps overlapped (the host launching step N+1 "
                         "before reading N) against the same engine synchronous, taking turns; seeded requests must "
                         "give the same tokens both ways")
    ap.add_argument("--profile", action="store_true", help="kernels and GPU busy time of a few with-drafter steps")
    ap.add_argument("--host", action="store_true",
                    help="cProfile the host's Python over the with-drafter generation (top functions by own and by "
                         "cumulative time)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from engine import triton_ops

    if args.linears == "torch":
        triton_ops.SKINNY_MAX_ROWS = 0
    triton_ops.FUSED_LAYERS = {"fused": True, "unfused": False}.get(args.linears, triton_ops.FUSED_LAYERS)
    base, spec, prompts = pair_engines(args) if args.preset == "demo" else random_engines(args)
    if args.overlap_ab:
        overlap_ab(args, spec, prompts)
        return
    run(base, prompts[:2], 8, args.batch, phases=False)          # warm-up
    run(spec, prompts[:2], 8, args.batch, phases=False)
    passes = []
    for i in range(args.repeats):                               # taking turns; the phase pass only once
        passes.append((run(base, prompts, args.max_tokens, args.batch, phases=i == 0, temperature=args.temperature),
                       run(spec, prompts, args.max_tokens, args.batch, phases=i == 0, temperature=args.temperature)))
    ratios = sorted(sb["tokens_per_s"] / bb["tokens_per_s"] for bb, sb in passes)
    speedup = ratios[len(ratios) // 2]
    b = sorted((bb for bb, _ in passes), key=lambda r: r["tokens_per_s"])[len(passes) // 2]
    s = sorted((sb for _, sb in passes), key=lambda r: r["tokens_per_s"])[len(passes) // 2]
    b["phases"], s["phases"] = passes[0][0]["phases"], passes[0][1]["phases"]
    lossless = all(bb["outputs"] == sb["outputs"] for bb, sb in passes)
    total = sum(s["phases"].values())
    same = f"greedy outputs identical: {lossless}" if args.temperature <= 0 else \
        f"sampled at temperature {args.temperature:g} (outputs differ by design)"
    which = f"pair {args.pair}" if args.preset == "demo" else f"preset {args.preset}"
    print(f"{which} device {args.device} batch {args.batch}: {len(prompts)} prompts x "
          f"{args.max_tokens} tokens; {same}")
    print(f"target only   {b['tokens_per_s']:9.1f} tok/s")
    print(f"with drafter  {s['tokens_per_s']:9.1f} tok/s   speedup {speedup:.2f}x   mean AL "
          f"{s['mean_al']:.2f}   speedup/AL {speedup / s['mean_al']:.2f}")
    if len(ratios) > 1:
        print("speedup per pass (sorted): " + ", ".join(f"{r:.2f}" for r in ratios))
    print("with-drafter time split (a second pass, each phase synced): "
          + ", ".join(f"{k} {v / total:.0%}" for k, v in s["phases"].items()))
    if args.profile and args.device == "cuda":
        from benchmarks.engine_bench import profile_decode

        for name, engine in (("target only", base), ("with drafter", spec)):
            print(name, end=": ")
            profile_decode(engine, prompts[:args.batch], args.max_tokens)
    if args.host:
        import cProfile
        import pstats

        from engine import SamplingParams

        profiler = cProfile.Profile()
        profiler.runcall(_generate, spec, prompts, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True),
                         args.batch)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(40)
    if args.json:
        Path(args.json).write_text(json.dumps({"base": {k: v for k, v in b.items() if k != "outputs"},
                                               "spec": {k: v for k, v in s.items() if k != "outputs"},
                                               "speedup": speedup, "speedups": ratios, "lossless": lossless},
                                              indent=1))


if __name__ == "__main__":
    main()
