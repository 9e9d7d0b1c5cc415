"""DFlash speculative decoding over the engine: the drafter (serving and training), drafting (the engine verifies),
and the engine composed with it: ``build_engine`` (the Ray actors) and ``LLM`` (offline)."""

from spec_decode.dflash import DFlashFactory, DFlashSpeculator, UnboundDFlash
from spec_decode.drafter import DFlashConfig, DFlashDrafter
from spec_decode.llm import LLM, build_engine, build_engine_from_model

__all__ = ["LLM", "DFlashConfig", "DFlashDrafter", "DFlashFactory", "DFlashSpeculator", "UnboundDFlash",
           "build_engine", "build_engine_from_model"]
