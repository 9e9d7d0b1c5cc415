"""Engine assembly and the offline API: ``LLM(model=DIR, ...).generate(prompts, SamplingParams(...))``.

The engine knows no drafter: speculative decoding comes in through a ``SpeculatorFactory`` that the caller
passes (the DFlash package provides one, and its ``LLM`` / ``build_engine`` pass it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from engine.checkpoint import CheckpointError
from engine.cuda_graphs import CUDA_GRAPH_MODES
from engine.llm_engine import OVERLAP_MODES, LLMEngine, RequestOutput, Speculator
from engine.model import Qwen3Model
from engine.parallel import TensorParallel
from engine.sequence import SamplingParams
from engine.tokenizer import Tokenizer
from kv.layout import KVLayout, LayoutConfig, decide_layout, split_budget
from kv.manager import KVCacheManager
from kv.pool import BufferAllocator, KVPool
from kv.spec import KVLayerSpec, LayerOwner, make_layer_specs, parse_dtype

DEFAULT_KV_CACHE_BYTES = 256 * 2**20


@dataclass(frozen=True)
class EngineConfig:
    """Everything that shapes one engine; validated here, once."""

    model: str
    draft: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    kv_cache_dtype: str = "auto"             # "auto": the model dtype
    draft_kv_cache_dtype: str = "auto"       # "auto": the model dtype (never the target's FP8)
    kv_scale: float = 1.0                    # FP8 target layers' dequantisation scale
    page_size: int = 16
    num_pages: int | None = None             # overrides kv_cache_bytes
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    attention_backend: str | None = None     # "torch" | "triton"; None: triton on CUDA, torch on CPU
    shared_draft_kv: str = "auto"
    num_spec_tokens: int | None = None       # drafts per step; None: block_size - 1
    enable_prefix_caching: bool = True
    num_extra_kv_tokens: int = 0
    cuda_graphs: str = "auto"                # auto (CUDA, triton backend, no TP), on, decode (no ragged graphs), off
    overlap: str = "auto"                    # launch decode steps ahead of the host; "auto": on for CUDA without TP

    def __post_init__(self):
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.attention_backend not in (None, "torch", "triton"):
            raise ValueError(f"attention_backend must be 'torch' or 'triton', got {self.attention_backend!r}")
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {self.num_pages}")
        if self.cuda_graphs not in CUDA_GRAPH_MODES:
            raise ValueError(f"cuda_graphs must be one of {CUDA_GRAPH_MODES}, got {self.cuda_graphs!r}")
        if self.overlap not in OVERLAP_MODES:
            raise ValueError(f"overlap must be one of {OVERLAP_MODES}, got {self.overlap!r}")

    @property
    def backend(self) -> str:
        if self.attention_backend:
            return self.attention_backend
        return "triton" if torch.device(self.device).type == "cuda" else "torch"


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """A KV cache dtype setting (``kv_cache_dtype``, ``draft_kv_cache_dtype``) resolved: "auto" is the model's."""
    return model_dtype if name == "auto" else parse_dtype(name)


class UnboundSpeculator(Protocol):
    """A speculator whose drafter is loaded but has no KV yet: what sizing the KV manager needs from it."""

    kv_layer_specs: Sequence[KVLayerSpec]    # the draft layers' KV (owner DRAFT), in the draft KV dtype
    lookahead_tokens: int                    # KV slots one step may write past the computed history

    def bind(self, kv: KVCacheManager) -> Speculator:
        """The speculator over its draft layers in ``kv`` (the engine's manager, built from the specs above)."""
        ...


class SpeculatorFactory(Protocol):
    """How an engine gets a speculator without knowing the drafter: given the loaded target and the config, it
    loads (or adopts) the drafter; the engine sizes the KV from the result, then binds it."""

    def __call__(self, model: Qwen3Model, config: EngineConfig) -> UnboundSpeculator: ...


def _require_speculator(config: EngineConfig, speculator: SpeculatorFactory | None) -> None:
    if config.draft is not None and speculator is None:
        raise ValueError(f"draft={config.draft!r} is set but no speculator factory was given: the engine loads no "
                         "drafter itself. Build through the DFlash package's build_engine / LLM, or pass speculator= "
                         "(a SpeculatorFactory)")


def _require_device(device: str) -> None:
    """A device this process can use, or a ValueError saying why not (before any weights load)."""
    try:
        where = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {device!r} is not a torch device: {e}") from None
    if where.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: no CUDA device is usable here (torch {torch.__version__}, "
                             f"CUDA build {torch.version.cuda or 'none'})")
        if where.index is not None and where.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: this process sees {torch.cuda.device_count()} CUDA device(s)")


def build_engine(config: EngineConfig, allocate: BufferAllocator | None = None,
                 speculator: SpeculatorFactory | None = None, tp: TensorParallel | None = None) -> LLMEngine:
    """Load the target, decide the KV layout, size the pools and assemble an engine; ``speculator`` loads the
    drafter (required when ``config.draft`` is set); ``tp``: this rank's shard of a tensor-parallel group."""
    _require_speculator(config, speculator)
    dtype = parse_dtype(config.dtype, "model dtype")
    if dtype == torch.float8_e4m3fn:
        raise ValueError("the model dtype cannot be fp8; use kv_cache_dtype for an FP8 KV cache")
    _require_device(config.device)
    if not Path(config.model).is_dir():
        raise CheckpointError(f"model directory {config.model!r} does not exist")
    model = Qwen3Model.from_pretrained(config.model, device=config.device, dtype=dtype, tp=tp)
    tokenizer = Tokenizer(config.model) if (Path(config.model) / "tokenizer.json").is_file() else None
    return build_engine_from_model(model, config, allocate, tokenizer, speculator)


def build_engine_from_model(model: Qwen3Model, config: EngineConfig, allocate: BufferAllocator | None = None,
                            tokenizer: Tokenizer | None = None,
                            speculator: SpeculatorFactory | None = None) -> LLMEngine:
    """Assemble an engine around a loaded target (and the speculator's drafter); benchmarks pass random
    weights this way."""
    _require_speculator(config, speculator)
    dtype = model.dtype
    c = model.config
    target_dtype = kv_cache_dtype(config.kv_cache_dtype, dtype)
    scale = config.kv_scale if target_dtype == torch.float8_e4m3fn else 1.0
    # Under TP each rank's pool holds its share of the kv heads; every rank sizes the same number of pages.
    target_specs = make_layer_specs(LayerOwner.TARGET, c.num_hidden_layers, target_dtype, model.num_kv_heads,
                                    c.head_dim, scale)
    draft_specs: list[KVLayerSpec] = []
    layout: KVLayout | None = None
    lookahead = config.num_extra_kv_tokens
    unbound = speculator(model, config) if speculator is not None else None
    if unbound is not None:
        draft_specs = list(unbound.kv_layer_specs)
        layout = decide_layout(config.shared_draft_kv, LayoutConfig(
            page_size=config.page_size, target_attention_backend=config.backend,
            draft_attention_backend=config.backend))
        lookahead = max(lookahead, unbound.lookahead_tokens)
    spaces = [target_specs + draft_specs] if (layout is None or layout.unified) else [target_specs, draft_specs]
    if config.num_pages is not None:
        pages = [config.num_pages] * len(spaces)
    else:
        pages = split_budget(config.kv_cache_bytes, config.page_size, spaces)
    pools = [KVPool(specs, config.page_size, n, config.device, allocate) for specs, n in zip(spaces, pages)]
    kv = KVCacheManager(pools, lookahead_tokens=lookahead, enable_prefix_caching=config.enable_prefix_caching,
                        drafter_in_use=unbound is not None)
    max_model_len = min(config.max_model_len or c.max_position_embeddings, c.max_position_embeddings)
    return LLMEngine(model, tokenizer, kv, backend=config.backend, max_num_seqs=config.max_num_seqs,
                     max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=max_model_len,
                     speculator=unbound.bind(kv) if unbound is not None else None, layout=layout,
                     cuda_graphs=config.cuda_graphs, overlap=config.overlap)


class LLM:
    """Offline batch generation over one engine. ``draft`` needs a ``speculator`` factory to load it (the
    DFlash package's ``LLM`` is this class with its factory)."""

    def __init__(self, model: str | Path, draft: str | Path | None = None,
                 speculator: SpeculatorFactory | None = None, **kwargs):
        self.config = EngineConfig(model=str(model), draft=None if draft is None else str(draft), **kwargs)
        self.engine = build_engine(self.config, speculator=speculator)

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    @property
    def kv_layout(self) -> KVLayout | None:
        """The unified/separate decision and its reasons (None without a drafter)."""
        return self.engine.layout

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer.json; pass token ids")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def generate(self, prompts: Sequence[str | Sequence[int]] | str, params: SamplingParams | None = None,
                 progress: bool = False) -> list[RequestOutput]:
        if isinstance(prompts, str):
            prompts = [prompts]
        params = params or SamplingParams()
        encoded = [self.encode(p) for p in prompts]
        engine = self.engine
        added = []
        try:
            for ids in encoded:
                added.append(engine.add_request(ids, params).request_id)
        except Exception:
            for request_id in added:
                engine.abort(request_id)
            raise
        results: dict[str, RequestOutput] = {}
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=len(added), desc="generate", unit="req")
        while len(results) < len(added):
            for out in engine.step():
                if out.finished:
                    results[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [results[request_id] for request_id in added]
