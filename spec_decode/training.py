"""Training of the bundled demo pair: a small Qwen3 target on Python stdlib source and a DFlash drafter
distilled from it, plus a dense greedy speculative-decoding evaluator that reports acceptance length.

The target is plain transformers; the drafter is the one the engine serves (spec_decode.drafter), trained
through its dense forward. Runs on CPU or one GPU; the serving engine never imports this module.
"""

from __future__ import annotations

import inspect
import json
import lzma
import math
import random
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from spec_decode.drafter import DFlashConfig, DFlashDrafter

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [EOS_TOKEN, MASK_TOKEN, IM_START, IM_END]   # ids 0..3, in this order

CHAT_TEMPLATE = (
    "{% for message in messages %}" + IM_START + "{{ message['role'] }}\n{{ message['content'] }}" + IM_END + "\n"
    "{% endfor %}{% if add_generation_prompt %}" + IM_START + "assistant\n{% endif %}"
)

# Top-level stdlib modules whose source (and whose tests, test/test_<name>*) never enter training. A fixed list
# rather than a hash so the split reads the same on any Python version and anyone can see what is held out.
HELDOUT_MODULES = frozenset({
    "argparse", "bisect", "calendar", "configparser", "csv", "difflib", "fractions",
    "heapq", "json", "shlex", "statistics", "textwrap", "tomllib",
})
# Folders that are data rather than code (codec tables, pydoc's topic text, py2 fixtures) or not the stdlib.
SKIPPED_DIRS = frozenset({"site-packages", "__pycache__", "encodings", "pydoc_data", "data"})
MAX_FILE_BYTES = 256_000    # the few larger files are generated blobs


@dataclass(frozen=True)
class Preset:
    name: str
    # corpus and tokenizer
    vocab_size: int
    max_train_chars: int | None     # trims the corpus (smoke) so tokenizer training stays quick
    # target
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    seq_len: int
    batch_size: int
    max_steps: int
    time_budget_s: float            # training stops at max_steps or this, whichever first; the LR decays to match
    lr: float
    warmup_steps: int
    eval_every: int
    eval_windows: int               # seq_len windows per loss measurement
    # drafter
    block_size: int
    num_draft_layers: int
    target_layer_ids: tuple[int, ...]
    distill_seq_len: int            # each prompt is continued greedily up to this many tokens
    distill_prompt_lens: tuple[int, ...]
    distill_max_sequences: int
    distill_gen_batch: int
    distill_time_budget_s: float
    drafter_batch: int
    anchors_per_seq: int
    drafter_max_steps: int
    drafter_time_budget_s: float
    drafter_lr: float
    drafter_warmup_steps: int
    # evaluation
    num_eval_prompts: int
    eval_new_tokens: int


PRESETS = {
    # Sized for one H200 call of about six minutes; the bundled models/demo pair came from exactly these values.
    # target_layer_ids skip the last layer: Hugging Face's hidden_states[num_layers] is the final-norm output,
    # not that layer's output, which would blur the contract. 450 target steps (~7 epochs of the 8M-token
    # corpus) stop near the best held-out loss; 1200 overfit (2.43 held out) and its drafter reached AL 2.28.
    "demo": Preset(
        name="demo", vocab_size=4096, max_train_chars=None,
        hidden_size=256, num_layers=6, num_heads=4, num_kv_heads=2, head_dim=64, intermediate_size=768,
        seq_len=1024, batch_size=128, max_steps=450, time_budget_s=60.0, lr=3e-3, warmup_steps=100,
        eval_every=400, eval_windows=512,
        block_size=8, num_draft_layers=3, target_layer_ids=(0, 2, 4),
        distill_seq_len=512, distill_prompt_lens=(64, 128, 192, 256), distill_max_sequences=24576,
        distill_gen_batch=2048, distill_time_budget_s=50.0,
        drafter_batch=256, anchors_per_seq=32, drafter_max_steps=6000, drafter_time_budget_s=190.0,
        drafter_lr=2e-3, drafter_warmup_steps=100,
        num_eval_prompts=64, eval_new_tokens=128,
    ),
    # A target big enough that a decode step is bound by the GPU rather than the host (1.76B parameters, 7 GB in
    # float32: Qwen3-1.7B's shape with an MLP of 8192), for measuring speedup / AL on the GPU. Sized for one call of
    # about six minutes: far from trained (a few million tokens), which speed measurements do not need. Not yet
    # run on a GPU (models/demo/TRAINING.md has the command and what was checked).
    "gpu": Preset(
        name="gpu", vocab_size=4096, max_train_chars=None,
        hidden_size=2048, num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128, intermediate_size=8192,
        seq_len=1024, batch_size=6, max_steps=2000, time_budget_s=60.0, lr=6e-4, warmup_steps=30,
        eval_every=10_000, eval_windows=64,
        block_size=8, num_draft_layers=2, target_layer_ids=(1, 13, 25),
        distill_seq_len=384, distill_prompt_lens=(64, 128), distill_max_sequences=4096,
        distill_gen_batch=256, distill_time_budget_s=25.0,
        drafter_batch=16, anchors_per_seq=32, drafter_max_steps=4000, drafter_time_budget_s=60.0,
        drafter_lr=6e-4, drafter_warmup_steps=30,
        num_eval_prompts=8, eval_new_tokens=64,
    ),
    # Proves the pipeline end to end on a 2-core CPU in about a minute; its numbers mean nothing.
    "smoke": Preset(
        name="smoke", vocab_size=512, max_train_chars=1_500_000,
        hidden_size=64, num_layers=3, num_heads=2, num_kv_heads=1, head_dim=32, intermediate_size=128,
        seq_len=128, batch_size=16, max_steps=60, time_budget_s=30.0, lr=3e-3, warmup_steps=10,
        eval_every=30, eval_windows=32,
        block_size=4, num_draft_layers=1, target_layer_ids=(0, 1),
        distill_seq_len=96, distill_prompt_lens=(32, 48), distill_max_sequences=64,
        distill_gen_batch=32, distill_time_budget_s=20.0,
        drafter_batch=16, anchors_per_seq=8, drafter_max_steps=40, drafter_time_budget_s=20.0,
        drafter_lr=3e-3, drafter_warmup_steps=5,
        num_eval_prompts=4, eval_new_tokens=32,
    ),
}


class RunLog:
    """Prints progress lines with elapsed time and appends them to a file."""

    def __init__(self, path: Path | None):
        self.path = path
        self.start = time.perf_counter()
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("")

    def __call__(self, message: str) -> None:
        line = f"[{time.perf_counter() - self.start:7.1f}s] {message}"
        print(line, flush=True)
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(line + "\n")


# ---------------------------------------------------------------------------------------------------------------
# Corpus: stdlib source, split by module
# ---------------------------------------------------------------------------------------------------------------

def module_name(relative_path: Path) -> str:
    parts = list(relative_path.with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def module_topic(module: str) -> str:
    """The top-level module a file is about: `json.decoder` -> json, `test.test_json.test_dump` -> json."""
    parts = module.split(".")
    if parts[0] == "test" and len(parts) > 1:
        return parts[1].removeprefix("test_")
    return parts[0]


def split_of(module: str) -> str:
    return "heldout" if module_topic(module) in HELDOUT_MODULES else "train"


def build_corpus(stdlib_dir: str | Path) -> list[dict]:
    """Every readable .py file of the stdlib as {"module", "text"}, sorted by module name."""
    root = Path(stdlib_dir)
    records = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if SKIPPED_DIRS.intersection(relative.parts[:-1]) or path.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):   # the test suite's deliberately mis-encoded files
            continue
        if text.strip():
            records.append({"module": module_name(relative), "text": text})
    records.sort(key=lambda r: r["module"])
    return records


def save_corpus(records: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with lzma.open(path, "wt", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")


def load_corpus(path: Path) -> list[dict]:
    with lzma.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def split_corpus(records: list[dict], max_train_chars: int | None = None) -> tuple[list[dict], list[dict]]:
    train = [r for r in records if split_of(r["module"]) == "train"]
    heldout = [r for r in records if split_of(r["module"]) == "heldout"]
    if max_train_chars is not None:
        # An evenly spaced subset, so a trimmed corpus still spans the whole library.
        total = sum(len(r["text"]) for r in train)
        stride = max(1, math.ceil(total / max_train_chars))
        train = train[::stride]
    return train, heldout


# ---------------------------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------------------------

def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE, so any text (including held-out source) encodes without unknown tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tokenizer


def encode_documents(tokenizer, texts: list[str]) -> torch.Tensor:
    """One token stream: each document followed by EOS, so the model learns where files end."""
    eos = tokenizer.token_to_id(EOS_TOKEN)
    pieces = []
    for encoding in tokenizer.encode_batch(texts, add_special_tokens=False):
        pieces.append(np.asarray(encoding.ids, dtype=np.int64))
        pieces.append(np.asarray([eos], dtype=np.int64))
    return torch.from_numpy(np.concatenate(pieces))


def make_heldout_prompts(heldout: list[dict], tokenizer, count: int = 64, min_tokens: int = 64,
                         max_tokens: int = 256, seed: int = 1234) -> list[dict]:
    """Line-aligned snippets of held-out library source (not its tests), `min_tokens..max_tokens` tokens long,
    chosen reproducibly; a module is drawn uniformly first so that json's many small files do not dominate."""
    rng = random.Random(seed)
    by_topic: dict[str, list[dict]] = {}
    for r in heldout:
        if not r["module"].startswith("test") and r["text"].count("\n") >= 20:
            by_topic.setdefault(module_topic(r["module"]), []).append(r)
    topics = sorted(by_topic)
    prompts, seen = [], set()
    for _ in range(count * 50):
        if len(prompts) == count:
            break
        record = rng.choice(by_topic[rng.choice(topics)])
        lines = record["text"].splitlines(keepends=True)
        want = rng.randint(min_tokens, max_tokens)
        start = rng.randrange(len(lines))
        text, n_tokens = "", 0
        for line in lines[start:]:
            n_line = len(tokenizer.encode(text + line, add_special_tokens=False).ids)
            if n_line > max_tokens:
                break
            text, n_tokens = text + line, n_line
            if n_tokens >= want:
                break
        if n_tokens >= min_tokens and text.strip() and (record["module"], start) not in seen:
            seen.add((record["module"], start))
            prompts.append({"prompt": text, "source": record["module"]})
    return prompts


# ---------------------------------------------------------------------------------------------------------------
# Target: a Hugging Face Qwen3 trained from scratch
# ---------------------------------------------------------------------------------------------------------------

def make_target(preset: Preset, vocab_size: int, eos_id: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=preset.hidden_size, intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_layers, num_attention_heads=preset.num_heads,
        num_key_value_heads=preset.num_kv_heads, head_dim=preset.head_dim, max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rms_norm_eps=1e-6,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=eos_id, pad_token_id=eos_id,
    )
    return Qwen3ForCausalLM(config)


def make_adamw(model: nn.Module, lr: float, device: torch.device) -> torch.optim.Optimizer:
    # Decay matrices only: decaying norm gains pulls them toward zero for no benefit.
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=device.type == "cuda")


def scheduled_lr(step: int, progress: float, peak: float, warmup_steps: int) -> float:
    """Linear warmup, then cosine to a tenth of peak over `progress` (0..1, by steps or by time)."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    return peak * (0.1 + 0.45 * (1.0 + math.cos(math.pi * min(progress, 1.0))))


def autocast(device: torch.device):
    # bf16 autocast on GPU; CPU runs in fp32 (CPU bf16 matmuls are slow on the CI machine).
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def sample_windows(ids: torch.Tensor, batch_size: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """Windows of `length` tokens at random offsets: every epoch sees the data cut differently."""
    starts = torch.randint(0, ids.numel() - length, (batch_size,), generator=gen, device=ids.device)
    return ids[starts[:, None] + torch.arange(length, device=ids.device)]


def target_train_step(model, optimizer, windows: torch.Tensor, device: torch.device) -> torch.Tensor:
    inputs, labels = windows[:, :-1], windows[:, 1:]
    with autocast(device):
        logits = model(input_ids=inputs).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss.detach()


@torch.no_grad()
def mean_token_loss(model, ids: torch.Tensor, seq_len: int, batch_size: int, device: torch.device,
                    max_windows: int = 512) -> float:
    """Mean next-token cross-entropy (nats) over non-overlapping windows of a token stream."""
    was_training = model.training
    model.eval()
    n = min((ids.numel() - 1) // seq_len, max_windows)
    inputs = ids[: n * seq_len].view(n, seq_len)
    labels = ids[1: n * seq_len + 1].view(n, seq_len)
    total = 0.0
    for i in range(0, n, batch_size):
        with autocast(device):
            logits = model(input_ids=inputs[i:i + batch_size]).logits
        total += F.cross_entropy(logits.flatten(0, 1).float(), labels[i:i + batch_size].flatten(),
                                 reduction="sum").item()
    model.train(was_training)
    return total / (n * seq_len)


def train_target(model, train_ids: torch.Tensor, heldout_ids: torch.Tensor, preset: Preset,
                 device: torch.device, log: Callable[[str], None]) -> dict:
    """Trains in place until max_steps or the time budget; returns the losses and timings for TRAINING.md."""
    model.train()
    optimizer = make_adamw(model, preset.lr, device)
    gen = torch.Generator(device=train_ids.device).manual_seed(0)
    tokens_per_step = preset.batch_size * preset.seq_len
    log_every = max(1, preset.max_steps // 40)
    start, step, history = time.perf_counter(), 0, []
    while True:
        elapsed = time.perf_counter() - start
        progress = max(step / preset.max_steps, elapsed / preset.time_budget_s)
        if progress >= 1.0:
            break
        for group in optimizer.param_groups:
            group["lr"] = scheduled_lr(step, progress, preset.lr, preset.warmup_steps)
        windows = sample_windows(train_ids, preset.batch_size, preset.seq_len + 1, gen)
        loss = target_train_step(model, optimizer, windows, device)
        step += 1
        if step % log_every == 0 or step == 1:
            elapsed = time.perf_counter() - start
            seen = step * tokens_per_step
            log(f"target step {step} loss {loss.item():.4f} lr {optimizer.param_groups[0]['lr']:.2e} "
                f"{seen / elapsed / 1e3:.0f}k tok/s epochs {seen / train_ids.numel():.2f}")
        if step % preset.eval_every == 0:
            heldout = mean_token_loss(model, heldout_ids, preset.seq_len, preset.batch_size, device,
                                      preset.eval_windows)
            history.append((step, loss.item(), heldout))
            log(f"target step {step} held-out loss {heldout:.4f}")
    seconds = time.perf_counter() - start
    train_loss = mean_token_loss(model, train_ids, preset.seq_len, preset.batch_size, device, preset.eval_windows // 2)
    heldout_loss = mean_token_loss(model, heldout_ids, preset.seq_len, preset.batch_size, device, preset.eval_windows)
    log(f"target done: {step} steps in {seconds:.1f}s, train loss {train_loss:.4f}, held-out loss {heldout_loss:.4f}")
    return {"steps": step, "seconds": round(seconds, 1), "tokens": step * tokens_per_step,
            "epochs": round(step * tokens_per_step / train_ids.numel(), 2), "train_loss": round(train_loss, 4),
            "heldout_loss": round(heldout_loss, 4), "history": history}


@contextmanager
def captured_layer_outputs(target, layer_ids: tuple[int, ...]) -> Iterator[dict[int, torch.Tensor]]:
    """Records the output of each listed decoder layer (= Hugging Face hidden_states[layer_id + 1])."""
    outputs: dict[int, torch.Tensor] = {}

    def recorder(layer_id: int):
        def hook(module, args, output):
            outputs[layer_id] = output[0] if isinstance(output, tuple) else output
        return hook

    handles = [target.model.layers[i].register_forward_hook(recorder(i)) for i in layer_ids]
    try:
        yield outputs
    finally:
        for handle in handles:
            handle.remove()


def target_forward(target, input_ids: torch.Tensor, layer_ids: tuple[int, ...],
                   with_logits: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Target logits (optional) and the drafter's raw context features: layer outputs concatenated on features."""
    with captured_layer_outputs(target, layer_ids) as outputs:
        if with_logits:
            logits = target(input_ids=input_ids).logits
        else:
            target.model(input_ids=input_ids)
            logits = None
    return logits, torch.cat([outputs[i] for i in layer_ids], dim=-1)


def save_target(model, tokenizer, out_dir: Path) -> None:
    """Hugging Face directory: bf16 safetensors, config, generation config, tokenizer.json and its config."""
    from transformers import GenerationConfig

    out_dir.mkdir(parents=True, exist_ok=True)
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    model.generation_config = GenerationConfig(bos_token_id=None, eos_token_id=eos_id, pad_token_id=eos_id,
                                               do_sample=False)
    model.to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    config = json.loads((out_dir / "config.json").read_text())
    # Newer transformers nest rope_theta under rope_parameters; readers that expect the flat key find it too.
    config["rope_theta"] = config.get("rope_parameters", {}).get("rope_theta", 10000.0)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer.save(str(out_dir / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None, "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN, "unk_token": None,
        "mask_token": MASK_TOKEN, "add_bos_token": False, "add_eos_token": False,
        "clean_up_tokenization_spaces": False, "model_max_length": 2048, "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def load_target(target_dir: Path, device: torch.device, dtype: torch.dtype = torch.float32):
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM.from_pretrained(target_dir, dtype=dtype).to(device).eval()


# ---------------------------------------------------------------------------------------------------------------
# Drafter: the serving drafter (spec_decode.drafter), trained through its dense forward
# ---------------------------------------------------------------------------------------------------------------

def drafter_config(preset: Preset, vocab_size: int, mask_token_id: int) -> DFlashConfig:
    """The preset's drafter: the target's layer shapes, ``num_draft_layers`` deep, reading ``target_layer_ids``."""
    return DFlashConfig(
        hidden_size=preset.hidden_size, num_hidden_layers=preset.num_draft_layers,
        num_attention_heads=preset.num_heads, num_key_value_heads=preset.num_kv_heads, head_dim=preset.head_dim,
        intermediate_size=preset.intermediate_size, vocab_size=vocab_size, block_size=preset.block_size,
        mask_token_id=mask_token_id, target_layer_ids=preset.target_layer_ids, num_target_layers=preset.num_layers)


# ---------------------------------------------------------------------------------------------------------------
# Distillation: the drafter learns the target's own greedy continuations
# ---------------------------------------------------------------------------------------------------------------

@torch.no_grad()
def greedy_continue(target, prompts: torch.Tensor, new_tokens: int, device: torch.device) -> torch.Tensor:
    """Prompts (batch, P) extended by the target's greedy tokens, with a KV cache: (batch, P + new_tokens)."""
    # Newer transformers call the KV cache argument `cache` (formerly `past_key_values`); use whichever exists.
    cache_arg = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"
    with autocast(device):
        out = target(input_ids=prompts, use_cache=True, logits_to_keep=1)
        next_token = out.logits[:, -1].argmax(-1)
        generated = [next_token]
        for _ in range(new_tokens - 1):
            out = target(input_ids=next_token[:, None], use_cache=True, **{cache_arg: out[cache_arg]})
            next_token = out.logits[:, -1].argmax(-1)
            generated.append(next_token)
    return torch.cat([prompts, torch.stack(generated, dim=1)], dim=1)


@torch.no_grad()
def build_distill_set(target, train_ids: torch.Tensor, preset: Preset, device: torch.device,
                      log: Callable[[str], None]) -> tuple[torch.Tensor, torch.Tensor]:
    """Training prompts continued greedily by the target to a common length; returns (sequences, prompt_lens).

    Labels from these continuations are exactly what greedy verification accepts, context included:
    at decode time the drafter also conditions on the target's own generated tokens."""
    gen = torch.Generator(device=train_ids.device).manual_seed(1)
    sequences, prompt_lens, start, i = [], [], time.perf_counter(), 0
    while sum(s.shape[0] for s in sequences) < preset.distill_max_sequences:
        if sequences and time.perf_counter() - start > preset.distill_time_budget_s:
            break
        prompt_len = preset.distill_prompt_lens[i % len(preset.distill_prompt_lens)]
        prompts = sample_windows(train_ids, preset.distill_gen_batch, prompt_len, gen)
        sequences.append(greedy_continue(target, prompts, preset.distill_seq_len - prompt_len, device))
        prompt_lens.append(torch.full((prompts.shape[0],), prompt_len, device=device))
        i += 1
    sequences, prompt_lens = torch.cat(sequences), torch.cat(prompt_lens)
    generated = (preset.distill_seq_len - prompt_lens).sum().item()
    log(f"distill set: {sequences.shape[0]} sequences of {preset.distill_seq_len} tokens "
        f"({generated / 1e6:.2f}M generated) in {time.perf_counter() - start:.1f}s")
    return sequences, prompt_lens


def anchor_block_mask(anchors: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """Bool mask (S, 1, A*B, T + A*B): block a sees context positions < its anchor and only its own block."""
    S, A = anchors.shape
    device = anchors.device
    sees_context = torch.arange(context_len, device=device) < anchors[:, :, None]             # (S, A, T)
    sees_context = sees_context[:, :, None, :].expand(S, A, block_size, context_len).reshape(S, A * block_size, -1)
    block_of = torch.arange(A * block_size, device=device) // block_size
    sees_block = (block_of[:, None] == block_of[None, :]).expand(S, -1, -1)
    return torch.cat([sees_context, sees_block], dim=-1)[:, None]


def slot_weights(block_size: int, device: torch.device) -> torch.Tensor:
    # exp(-(k-1)/gamma) for slots k = 1..B-1; gamma 7 at block 16, scaled with the block size.
    gamma = 7.0 * block_size / 16
    return torch.exp(-torch.arange(block_size - 1, device=device, dtype=torch.float32) / gamma)


def drafter_loss(drafter: DFlashDrafter, target, sequences: torch.Tensor, prompt_lens: torch.Tensor,
                 anchors_per_seq: int, device: torch.device, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted block cross-entropy over many anchors per sequence, and the batch's acceptance length."""
    c = drafter.config
    S, T = sequences.shape
    B, A = c.block_size, anchors_per_seq
    with torch.no_grad(), autocast(device):
        _, features = target_forward(target, sequences, c.target_layer_ids, with_logits=False)
    # Anchors lie in the generated part (the first is the prefill's bonus token at position prompt_len) with
    # the whole block inside it: p in [prompt_len, T - B].
    span = (T - B + 1 - prompt_lens)[:, None]
    anchors = prompt_lens[:, None] + (torch.rand(S, A, generator=gen, device=device) * span).long()
    positions = anchors[:, :, None] + torch.arange(B, device=device)                          # (S, A, B)
    block_tokens = torch.full((S, A, B), c.mask_token_id, device=device, dtype=sequences.dtype)
    block_tokens[:, :, 0] = sequences.gather(1, anchors)
    labels = sequences.gather(1, positions[:, :, 1:].reshape(S, -1)).view(S, A, B - 1)
    with autocast(device):
        embeds = target.model.embed_tokens(block_tokens.view(S, -1))
        hidden = drafter(embeds, positions.view(S, -1), features, torch.arange(T, device=device)[None],
                         anchor_block_mask(anchors, T, B))
        logits = drafter.compute_logits(hidden.view(S, A, B, -1)[:, :, 1:], target.lm_head.weight)
        ce = F.cross_entropy(logits.flatten(0, 2).float(), labels.flatten(), reduction="none").view(S, A, B - 1)
    weights = slot_weights(B, device)
    loss = (ce * weights).sum() / (weights.sum() * S * A)
    with torch.no_grad():
        acceptance = (logits.argmax(-1) == labels).int().cumprod(-1).sum(-1).float().mean() + 1
    return loss, acceptance


def train_drafter(drafter: DFlashDrafter, target, sequences: torch.Tensor, prompt_lens: torch.Tensor,
                  preset: Preset, device: torch.device, log: Callable[[str], None]) -> dict:
    drafter.train()
    for p in target.parameters():
        p.requires_grad_(False)
    optimizer = make_adamw(drafter, preset.drafter_lr, device)
    gen = torch.Generator(device=device).manual_seed(2)
    log_every = max(1, preset.drafter_max_steps // 40)
    start, step, recent_al = time.perf_counter(), 0, []
    while True:
        elapsed = time.perf_counter() - start
        progress = max(step / preset.drafter_max_steps, elapsed / preset.drafter_time_budget_s)
        if progress >= 1.0:
            break
        for group in optimizer.param_groups:
            group["lr"] = scheduled_lr(step, progress, preset.drafter_lr, preset.drafter_warmup_steps)
        rows = torch.randint(0, sequences.shape[0], (preset.drafter_batch,), generator=gen, device=device)
        loss, acceptance = drafter_loss(drafter, target, sequences[rows], prompt_lens[rows],
                                        preset.anchors_per_seq, device, gen)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
        step += 1
        if step % log_every == 0 or step == 1:
            recent_al.append(acceptance.item())
            log(f"drafter step {step} loss {loss.item():.4f} train AL {acceptance.item():.3f} "
                f"lr {optimizer.param_groups[0]['lr']:.2e} ({time.perf_counter() - start:.0f}s)")
    seconds = time.perf_counter() - start
    log(f"drafter done: {step} steps in {seconds:.1f}s")
    return {"steps": step, "seconds": round(seconds, 1), "final_loss": round(loss.item(), 4),
            "final_train_al": round(recent_al[-1], 3) if recent_al else None}


# ---------------------------------------------------------------------------------------------------------------
# Dense greedy speculative decoding: the acceptance-length yardstick
# ---------------------------------------------------------------------------------------------------------------

@torch.no_grad()
def speculative_greedy(target, drafter: DFlashDrafter, prompt: list[int],
                       max_new_tokens: int) -> tuple[list[int], list[int]]:
    """DFlash greedy decoding with full (cache-free) target and drafter forwards.

    Returns the new tokens and the number of drafts accepted at each step."""
    c = drafter.config
    device = next(target.parameters()).device
    tokens = torch.tensor([prompt], device=device)
    logits, features = target_forward(target, tokens, c.target_layer_ids)
    tokens = torch.cat([tokens, logits[:, -1:].argmax(-1)], dim=1)     # prefill's token: the first anchor
    mask_tail = torch.full((1, c.block_size - 1), c.mask_token_id, device=device)
    accepted_per_step = []
    while tokens.shape[1] - len(prompt) < max_new_tokens:
        anchor = tokens.shape[1] - 1            # newest token; the target has not run on it yet
        block = torch.cat([tokens[:, anchor:], mask_tail], dim=1)
        block_positions = torch.arange(anchor, anchor + c.block_size, device=device)[None]
        hidden = drafter(target.model.embed_tokens(block), block_positions,
                         features[:, :anchor], torch.arange(anchor, device=device)[None])
        drafts = drafter.compute_logits(hidden[:, 1:], target.lm_head.weight).argmax(-1)   # slot k: anchor + k
        logits, features = target_forward(target, torch.cat([tokens, drafts], dim=1), c.target_layer_ids)
        target_next = logits[0, anchor:].argmax(-1)                      # the target's token after each block slot
        # Accept the longest run of drafts the target agrees with, then the target's own next token as a bonus.
        # Features of every committed position are now known, so the next context is features[:, :new anchor].
        n_accepted = int(torch.cumprod((drafts[0] == target_next[:-1]).int(), dim=0).sum())
        tokens = torch.cat([tokens, drafts[:, :n_accepted], target_next[n_accepted].view(1, 1)], dim=1)
        accepted_per_step.append(n_accepted)
    return tokens[0, len(prompt):len(prompt) + max_new_tokens].tolist(), accepted_per_step


@torch.no_grad()
def greedy_reference(target, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Target-only greedy tokens for a batch of prompts, right-padded; causality keeps padding invisible."""
    device = next(target.parameters()).device
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    buffer = torch.zeros(len(prompts), int(lengths.max()) + max_new_tokens, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        buffer[i, :len(p)] = torch.tensor(p, device=device)
    rows = torch.arange(len(prompts), device=device)
    for _ in range(max_new_tokens):
        logits = target(input_ids=buffer[:, :int(lengths.max())]).logits
        buffer[rows, lengths] = logits[rows, lengths - 1].argmax(-1)
        lengths += 1
    return [buffer[i, len(p):len(p) + max_new_tokens].tolist() for i, p in enumerate(prompts)]


def evaluate_acceptance(target, drafter: DFlashDrafter, prompts: list[list[int]], max_new_tokens: int,
                        log: Callable[[str], None] | None = None) -> dict:
    """Mean AL = 1 + accepted drafts / drafting steps over all prompts, plus exactness against target-only greedy."""
    start = time.perf_counter()
    accepted, outputs = [], []
    for prompt in prompts:
        new_tokens, per_step = speculative_greedy(target, drafter, prompt, max_new_tokens)
        outputs.append(new_tokens)
        accepted.extend(per_step)
    seconds = time.perf_counter() - start
    reference = greedy_reference(target, prompts, max_new_tokens)
    B = drafter.config.block_size
    counts = np.bincount(np.asarray(accepted), minlength=B)
    accepted_arr = np.asarray(accepted)
    result = {
        "mean_al": round(1 + float(accepted_arr.mean()), 3),
        "steps": len(accepted), "accepted_tokens": int(accepted_arr.sum()), "prompts": len(prompts),
        "new_tokens_per_prompt": max_new_tokens,
        "accepted_histogram": counts.tolist(),           # index a: steps that accepted a drafts
        # What a shorter block would give if its first slots drafted the same tokens (an upper-bound estimate).
        "al_if_block": {b: round(1 + float(np.minimum(accepted_arr, b - 1).mean()), 3) for b in range(2, B + 1)},
        "exact_match_prompts": sum(o == r for o, r in zip(outputs, reference)),
        "seconds": round(seconds, 1),
    }
    if log is not None:
        log(f"acceptance: mean AL {result['mean_al']} over {result['steps']} steps; "
            f"histogram {result['accepted_histogram']}; spec output == target greedy for "
            f"{result['exact_match_prompts']}/{len(prompts)} prompts")
    return result
