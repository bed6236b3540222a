"""Maps a checkpoint's `architectures[0]` to the class that runs it."""

from __future__ import annotations

from torch import nn

from dgpp.engine.config import ModelConfig
from dgpp.engine.errors import UnsupportedModelError
from dgpp.engine.models.llama import LlamaForCausalLM
from dgpp.engine.parallel import ParallelContext
from dgpp.kernels.dispatch import AttentionKernels

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(MODEL_CLASSES)


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    """The class for the checkpoint's architecture; `UnsupportedModelError` if there is none."""
    found = MODEL_CLASSES.get(config.architecture)
    if found is None:
        raise UnsupportedModelError(
            f"architecture {config.architecture!r} is not supported; "
            f"supported: {', '.join(supported_architectures())}"
        )
    return found


def build_model(
    config: ModelConfig, parallel: ParallelContext, max_position: int, kernels: AttentionKernels
) -> nn.Module:
    return model_class(config)(config, parallel, max_position, kernels)
