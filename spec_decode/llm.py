"""The engine with DFlash speculative decoding: ``build_engine`` (what the Ray actors call) and the offline
``LLM(model=DIR, draft=DIR, ...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

from pathlib import Path

from engine import llm as engine_llm
from engine.llm import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model import Qwen3Model
from engine.parallel import TensorParallel
from engine.tokenizer import Tokenizer
from kv.pool import BufferAllocator
from spec_decode.dflash import DFlashFactory
from spec_decode.drafter import DFlashDrafter


def build_engine(config: EngineConfig, allocate: BufferAllocator | None = None,
                 tp: TensorParallel | None = None) -> LLMEngine:
    """An engine with the DFlash drafter ``config.draft`` (target-only when it is None); ``tp``: this rank's
    shard of a tensor-parallel group (target and drafter alike)."""
    factory = DFlashFactory() if config.draft is not None else None
    return engine_llm.build_engine(config, allocate, speculator=factory, tp=tp)


def build_engine_from_model(model: Qwen3Model, config: EngineConfig, allocate: BufferAllocator | None = None,
                            tokenizer: Tokenizer | None = None, drafter: DFlashDrafter | None = None) -> LLMEngine:
    """An engine around a loaded target, drafting with ``drafter`` (already loaded) or else ``config.draft``;
    target-only when neither is given. Benchmarks pass random weights this way."""
    factory = DFlashFactory(drafter) if drafter is not None or config.draft is not None else None
    return engine_llm.build_engine_from_model(model, config, allocate, tokenizer, speculator=factory)


class LLM(engine_llm.LLM):
    """The offline API, speculating with the DFlash drafter ``draft`` when it is given."""

    def __init__(self, model: str | Path, draft: str | Path | None = None, **kwargs):
        super().__init__(model, draft, speculator=DFlashFactory() if draft is not None else None, **kwargs)
