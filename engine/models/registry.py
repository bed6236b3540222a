"""Maps a checkpoint's `architectures[0]` to the class that runs it."""

from __future__ import annotations

from typing import Protocol

from torch import nn

from dgpp.engine.backends.base import PagedAttentionBackend
from dgpp.engine.backends.cache_spec import CacheSpec, at_kv_dtype, with_kv_dtype
from dgpp.engine.backends.state_cache import LinearStateSpec
from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.configuration.parallel import ParallelContext
from dgpp.engine.errors import UnsupportedModelError
from dgpp.engine.models.bert import ENCODER_CLASSES
from dgpp.engine.models.deepseek_v3 import DeepseekV3ForCausalLM
from dgpp.engine.models.deepseek_v4 import DeepseekV4ForCausalLM
from dgpp.engine.models.deepseek_v32 import DeepseekV32ForCausalLM, GlmMoeDsaForCausalLM
from dgpp.engine.models.glm4_moe import Glm4MoeForCausalLM
from dgpp.engine.models.gpt_oss import GptOssForCausalLM
from dgpp.engine.models.kimi_linear import KimiLinearForCausalLM
from dgpp.engine.models.llama import LlamaForCausalLM
from dgpp.engine.models.mimo_v2_flash import MiMoV2FlashForCausalLM
from dgpp.engine.models.minimax_m2 import MiniMaxM2ForCausalLM
from dgpp.engine.models.pooling import adapt_for_kind
from dgpp.engine.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
from dgpp.engine.models.qwen3_moe import Qwen3MoeForCausalLM
from dgpp.engine.models.qwen3_next import Qwen3NextForCausalLM
from dgpp.engine.models.qwen4_exp import Qwen4ExpForCausalLM
from dgpp.engine.models.vision_language import Qwen3VLForCausalLM, Qwen3VLMoeForCausalLM


class ModelClass(Protocol):
    """A model family: built per rank from the checkpoint's config; declares its caches."""

    def __call__(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        max_position: int,
        attention: PagedAttentionBackend,
    ) -> nn.Module: ...

    def cache_specs(self, config: ModelConfig, parallel: ParallelContext) -> list[CacheSpec]: ...

    def state_specs(
        self, config: ModelConfig, parallel: ParallelContext
    ) -> list[LinearStateSpec]: ...


MODEL_CLASSES: dict[str, ModelClass] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Glm4MoeForCausalLM": Glm4MoeForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "DeepseekV32ForCausalLM": DeepseekV32ForCausalLM,
    "GlmMoeDsaForCausalLM": GlmMoeDsaForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,
    "Qwen4ExpForCausalLM": Qwen4ExpForCausalLM,
    "MiniMaxM2ForCausalLM": MiniMaxM2ForCausalLM,
    "MiMoV2FlashForCausalLM": MiMoV2FlashForCausalLM,
    "KimiLinearForCausalLM": KimiLinearForCausalLM,
    "DeepseekV4ForCausalLM": DeepseekV4ForCausalLM,
    # the vision-language checkpoints, with their vision towers (`models.vision_language`),
    # but Qwen4-Exp's (text-only)
    "Qwen3VLForConditionalGeneration": Qwen3VLForCausalLM,
    "Qwen3VLMoeForConditionalGeneration": Qwen3VLMoeForCausalLM,
    "Qwen3_5ForConditionalGeneration": Qwen3_5ForCausalLM,
    "Qwen3_5MoeForConditionalGeneration": Qwen3_5MoeForCausalLM,
    "Qwen4ExpForConditionalGeneration": Qwen4ExpForCausalLM,
    **ENCODER_CLASSES,  # encoders, served as embedders and rerankers (`models.bert`)
}


def supported_architectures() -> list[str]:
    return sorted(MODEL_CLASSES)


def model_class(config: ModelConfig) -> ModelClass:
    """The class for the checkpoint's architecture; `UnsupportedModelError` if there is none."""
    found = MODEL_CLASSES.get(config.architecture)
    if found is None:
        raise UnsupportedModelError(
            f"architecture {config.architecture!r} is not supported; "
            f"supported: {', '.join(supported_architectures())}"
        )
    return found


def build_model(
    config: ModelConfig,
    parallel: ParallelContext,
    max_position: int,
    attention: PagedAttentionBackend,
    kind: str = "generate",
) -> nn.Module:
    """The model of `config`'s family, as `kind` (`engine.kind`) serves it."""
    return adapt_for_kind(model_class(config)(config, parallel, max_position, attention), kind)


def layer_cache_specs(
    config: ModelConfig, parallel: ParallelContext, kv_dtype: str = "auto"
) -> list[CacheSpec]:
    """The cache spec of every cache layer of this rank's model, in layer order, without
    building it (see `cache_specs` on each model class); paged keys and values at `kv_dtype`
    (`ConfigError` where a cache of the family cannot take it)."""
    specs = model_class(config).cache_specs(config, parallel)
    return with_kv_dtype(specs, kv_dtype, config.architecture)


def attention_workspace(
    config: ModelConfig, tokens: int, chunk: int, heads: int, max_context: int, dtype_bytes: int
) -> int | None:
    """A family's own estimate of one layer's attention activations in a step of `tokens`
    tokens (prefill chunks of `chunk`) against `max_context`, with `heads` query heads on the
    rank, where the generic one (dense scores against the whole context) does not describe it;
    None for the generic estimate."""
    estimate = getattr(model_class(config), "attention_workspace", None)
    if estimate is None:
        return None
    return int(estimate(config, tokens, chunk, heads, max_context, dtype_bytes))


def layer_mtp_cache_specs(
    config: ModelConfig, parallel: ParallelContext, kv_dtype: str = "auto"
) -> list[CacheSpec]:
    """The cache specs of the MTP layer: the family's `mtp_cache_specs` where it declares them
    (a layer of several caches), else the last layer's one."""
    found = model_class(config)
    own = getattr(found, "mtp_cache_specs", None)
    specs = (
        own(config, parallel) if own is not None else list(found.cache_specs(config, parallel))[-1:]
    )
    return with_kv_dtype(specs, kv_dtype, config.architecture)


def layer_state_specs(
    config: ModelConfig, parallel: ParallelContext, kv_dtype: str = "auto"
) -> list[LinearStateSpec]:
    """The state spec of every recurrent layer of this rank's model, in layer order (none for
    attention-only models); a state holding a sliding window's keys (a `kv_dtype` field) stores
    them at `kv_dtype`, recurrent states at their own precision."""
    specs = model_class(config).state_specs(config, parallel)
    if kv_dtype == "auto":
        return list(specs)
    return [at_kv_dtype(spec, kv_dtype) if hasattr(spec, "kv_dtype") else spec for spec in specs]
