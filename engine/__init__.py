"""dgpp inference engine: models, paged KV cache, scheduler, sampler and the offline `LLM` API.

The names below are imported on first use: a worker rank or a CLI command that needs only part
of the engine does not pay for the rest (the tokenizer's transformers import alone is ~1 s).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dgpp.engine.checkpoint.config import ModelConfig
    from dgpp.engine.configuration.engine_config import EngineConfig
    from dgpp.engine.llm import LLM
    from dgpp.engine.sampling.sampling_params import SamplingParams
    from dgpp.engine.scheduling.request import CompletionOutput, RequestOutput

_EXPORTS = {
    "LLM": "dgpp.engine.llm",
    "CompletionOutput": "dgpp.engine.scheduling.request",
    "EngineConfig": "dgpp.engine.checkpoint.config",
    "ModelConfig": "dgpp.engine.checkpoint.config",
    "RequestOutput": "dgpp.engine.scheduling.request",
    "SamplingParams": "dgpp.engine.sampling.sampling_params",
}

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "ModelConfig",
    "RequestOutput",
    "SamplingParams",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dgpp.engine' has no attribute {name!r}")
    return getattr(import_module(module), name)
