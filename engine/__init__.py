"""dgpp inference engine: models, paged KV cache, scheduler, sampler and the offline `LLM` API."""

from dgpp.engine.config import EngineConfig, ModelConfig
from dgpp.engine.llm import LLM
from dgpp.engine.request import CompletionOutput, RequestOutput
from dgpp.engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "ModelConfig",
    "RequestOutput",
    "SamplingParams",
]
