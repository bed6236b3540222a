"""Configuration resolved once: (deployment or flags) + checkpoint -> what every rank runs.

`resolve` reads the checkpoint's `config.json` once, refuses what cannot be served before any
weight is read (a quantization other than the one asked for, an unknown architecture), sizes
the KV pool from `memory_fraction` (`memory_plan.size_kv_pool`) and fixes the context limit.
Rank 0 resolves; `LLMEngine` takes the result and reads no configuration itself; the other ranks
build from what rank 0 pushes of it (`distributed.worker.pushed_config`: the sized engine
configuration and rank 0's reading of config.json); the console's preview and
`dgpp deploy plan` plan the memory of the same `ResolvedConfig`
(`appliance.deployments.plan.resolve_deployment`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.configuration.engine_config import EngineConfig
from dgpp.engine.errors import ConfigError
from dgpp.engine.models.bert import XLM_ROBERTA
from dgpp.engine.models.registry import model_class
from dgpp.engine.planning.memory_plan import DeviceMemory, size_kv_pool
from dgpp.engine.quant.quant_schemes import check_quantization


@dataclass(frozen=True)
class ResolvedConfig:
    """What one configuration on one checkpoint comes to. `engine` has its KV pool sized
    (`kv_capacity` is the pool, computed from `memory_fraction` where that is set; the fraction
    stays as the budget every rank checks its plan against) and `max_model_len` set."""

    engine: EngineConfig
    model: ModelConfig
    checkpoint: Path
    tp_size: int = 1

    @property
    def max_model_len(self) -> int:
        assert self.engine.max_model_len is not None
        return self.engine.max_model_len


def resolve(
    config: EngineConfig,
    checkpoint: Path,
    tp_size: int = 1,
    model: ModelConfig | None = None,
    memory: DeviceMemory | None = None,
) -> ResolvedConfig:
    """Resolve `config` on `checkpoint` for a world of `tp_size` ranks; `model` when the caller
    has already read the checkpoint's configuration."""
    model = model if model is not None else ModelConfig.from_checkpoint(checkpoint)
    check_quantization(config.quantization, model.quant_method)
    model_class(model)  # refuse unknown architectures before any heavy loading
    if model.is_encoder:
        config = encoder_config(config, model)
    # Only this step sizes the pool: the ranks run its `kv_capacity`.
    engine = size_kv_pool(config, model, tp_size, memory)
    engine = replace(engine, max_model_len=engine.effective_max_model_len(model))
    return ResolvedConfig(engine, model, checkpoint, tp_size)


def encoder_config(config: EngineConfig, model: ModelConfig) -> EngineConfig:
    """`config` as an encoder serves (`models.bert`): the kind its class serves, each prompt in
    one step (the prompt budget at least the context), no prefix cache (a later token changes
    the earlier ones' states), and a pool of bookkeeping blocks only (it holds no bytes)."""
    serves = "embed" if model.architecture in ("BertModel", "XLMRobertaModel") else "rerank"
    if config.kind != serves:
        raise ConfigError(
            f"{model.architecture} is an encoder that serves engine.kind={serves}; "
            f"this deployment asks for {config.kind}",
            param="kind",
        )
    offset = int(model.raw.get("pad_token_id", 1)) + 1 if model.architecture in XLM_ROBERTA else 0
    context = model.max_position_embeddings - offset
    if config.max_model_len is not None and config.max_model_len > context:
        raise ConfigError(
            f"max_model_len={config.max_model_len} exceeds this encoder's {context} positions",
            param="max_model_len",
        )
    context = config.max_model_len or context
    blocks = -(-context // config.block_size) * config.max_concurrency
    return replace(
        config,
        max_model_len=context,
        prefix_cache=False,
        prefill_chunk_tokens=max(config.prefill_chunk_tokens, context),
        memory_fraction=None,
        kv_capacity=blocks * config.block_size,
    )
