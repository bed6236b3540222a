"""Kimi-Linear (`KimiLinearForCausalLM`): a hybrid of Kimi Delta Attention layers
(`layers.kimi_delta`, a per-request state) and multi-head latent attention layers without
rotary (`mla_use_nope`: position comes from the KDA layers; the latent's "rope" dims are used
as they are), three KDA layers to one MLA layer, over DeepSeek-V3's MoE (sigmoid router with
correction bias, one shared expert, `routed_scaling_factor`; the first layer dense).

Which layers are which: transformers' `layer_types`, else the release's `linear_attn_config`
(`kda_layers` / `full_attn_layers`, numbered from 1). The release's names: `block_sparse_moe`
with Mixtral-style experts (`w1`, `w3`, `w2`), separate `q_conv1d` / `k_conv1d` / `v_conv1d`;
the DeepSeek-V3 keys it spells its own way (`num_experts`, `moe_renormalize`, ...) are read
through `dgpp.engine.checkpoint.config`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dgpp.engine.backends.base import PagedAttentionBackend
from dgpp.engine.backends.cache_spec import CacheSpec
from dgpp.engine.backends.state_cache import LinearStateBackend, LinearStateSpec
from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.configuration.parallel import ParallelContext
from dgpp.engine.errors import ModelLoadError
from dgpp.engine.layers.kimi_delta import KimiDeltaAttention, kda_state_spec
from dgpp.engine.layers.mla import MLADims, MultiHeadLatentAttention
from dgpp.engine.layers.moe import expert_target
from dgpp.engine.models.deepseek_v3 import DeepseekV3ForCausalLM
from dgpp.engine.models.llama import DecoderLayer
from dgpp.engine.models.minimax_m2 import minimax_checkpoint_name

LINEAR, FULL = "linear_attention", "full_attention"
_QKV = {"q_proj": "q", "k_proj": "k", "v_proj": "v"}
_CONVS = {"q_conv1d": 0, "k_conv1d": 1, "v_conv1d": 2}


def kimi_layer_types(config: ModelConfig) -> list[str]:
    raw, layers = config.raw, config.num_layers
    if raw.get("layer_types"):
        types = [str(kind) for kind in raw["layer_types"]]
    elif isinstance(raw.get("linear_attn_config"), dict) and raw["linear_attn_config"].get(
        "full_attn_layers"
    ):
        full = {int(i) - 1 for i in raw["linear_attn_config"]["full_attn_layers"]}
        types = [FULL if i in full else LINEAR for i in range(layers)]
    else:  # transformers' default: MLA in every fourth layer from the fifth
        types = [FULL if i and i % 4 == 0 else LINEAR for i in range(layers)]
    if len(types) != layers or set(types) - {LINEAR, FULL}:
        raise ModelLoadError(f"Kimi-Linear's layer types {types} for {layers} layers")
    return types


class KimiLinearForCausalLM(DeepseekV3ForCausalLM):
    checkpoint_name = staticmethod(minimax_checkpoint_name)  # the same Mixtral-style names

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        max_position: int,
        attention: PagedAttentionBackend,
    ) -> None:
        self._types = kimi_layer_types(config)
        self._state_backend = LinearStateBackend(getattr(attention, "device", torch.device("cpu")))
        super().__init__(config, parallel, max_position, attention)

    def checkpoint_target(self, name: str) -> tuple[str, Any] | None:
        """A KDA layer's q/k/v into its fused projection and its three convolutions into one
        weight; the routed experts as the MoE blocks keep them."""
        parts = name.split(".")
        if len(parts) == 6 and parts[3] == "self_attn" and self._types[int(parts[2])] == LINEAR:
            module = parts[4]
            if module in _QKV:
                return name.replace(f".{module}.", ".qkv_proj."), _QKV[module]
            if module in _CONVS:
                return name.replace(f".{module}.", ".conv1d."), _CONVS[module]
        return expert_target(name)

    def build_layer(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        attention: Any,
        index: int,
        prefix: str,
    ) -> nn.Module:
        mlp = self.build_mlp(config, parallel, index, f"{prefix}.mlp")
        mixer: nn.Module
        if self._types[index] == LINEAR:
            mixer = KimiDeltaAttention(config, parallel, self._state_backend, f"{prefix}.self_attn")
        else:
            mixer = MultiHeadLatentAttention(config, parallel, attention)
        return DecoderLayer(config, mixer, mlp)

    @classmethod
    def cache_specs(cls, config: ModelConfig, parallel: ParallelContext) -> list[CacheSpec]:
        """The MLA layers' latents."""
        return [MLADims.of(config).cache_spec] * kimi_layer_types(config).count(FULL)

    @classmethod
    def state_specs(cls, config: ModelConfig, parallel: ParallelContext) -> list[LinearStateSpec]:
        return [kda_state_spec(config, parallel)] * kimi_layer_types(config).count(LINEAR)
