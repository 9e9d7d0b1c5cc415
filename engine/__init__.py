"""The target model, attention over the paged pool, the scheduler, the sampler and the offline LLM API."""

from engine.llm import LLM, EngineConfig, build_engine
from engine.llm_engine import LLMEngine, RequestOutput
from engine.sequence import SamplingParams

__all__ = ["LLM", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams", "build_engine"]
