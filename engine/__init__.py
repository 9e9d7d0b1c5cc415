"""The target model, attention over the paged pool, the scheduler, the sampler and the offline LLM API."""

from engine.llm import LLM, EngineConfig, SpeculatorFactory, UnboundSpeculator, build_engine
from engine.llm_engine import LLMEngine, Proposal, RequestOutput, Speculator
from engine.sequence import SamplingParams, TokenLogprob

__all__ = ["LLM", "EngineConfig", "LLMEngine", "Proposal", "RequestOutput", "SamplingParams", "Speculator",
           "SpeculatorFactory", "TokenLogprob", "UnboundSpeculator", "build_engine"]
