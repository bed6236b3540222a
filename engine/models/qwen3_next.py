"""Qwen3-Next: a hybrid decoder. Most layers (`layer_types`, by default three of every four)
mix tokens with Gated DeltaNet linear attention (`layers.gated_deltanet`, a fixed-size state per
request), the others with gated full attention: per-head QK RMSNorm, rotary on a quarter of
each head, and an output gate (sigmoid, interleaved per head with the query rows of `q_proj`).
The MLP is a sparse MoE (softmax top-k router) with one shared expert scaled by a sigmoid gate.
Every RMSNorm but the linear layers' output norm is zero-centred: x * (1 + weight).

Only the full-attention layers have a paged KV cache; the linear ones declare state specs
(`state_specs`), which the memory plan and the runner's state pools follow. The checkpoints'
multi-token-prediction layer (`mtp.*`) is skipped at load and built apart with `speculative:
mtp` (`models.mtp`: `mtp_names`, `mtp_norm`, `build_mtp_block`, a full-attention layer).

Qwen3.5 (`models.qwen3_5`) subclasses this model: `split_projections` for its Gated DeltaNet
input projections, `build_mlp` for its MLPs, `checkpoint_name` for its checkpoint names.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dgpp.engine.backends.base import PagedAttentionBackend, StepMetadata
from dgpp.engine.backends.cache_spec import CacheSpec
from dgpp.engine.backends.state_cache import LinearStateBackend, LinearStateSpec
from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.configuration.parallel import ParallelContext
from dgpp.engine.layers.attention import PagedAttention
from dgpp.engine.layers.gated_deltanet import GatedDeltaNet, linear_state_spec
from dgpp.engine.layers.linear import QKVParallelLinear, RowParallelLinear
from dgpp.engine.layers.moe import Experts, SparseMoeBlock, expert_target
from dgpp.engine.layers.norm import ZeroCentredRMSNorm
from dgpp.engine.layers.rotary import RopeAngles, apply_rotary
from dgpp.engine.models.llama import DecoderLayer, DecoderMLP, LlamaForCausalLM
from dgpp.engine.models.moe_blocks import packed_experts
from dgpp.engine.models.moe_config import qwen3_moe_spec
from dgpp.engine.models.mtp import qwen_mtp_names


def layer_types(config: ModelConfig) -> list[str]:
    """'linear_attention' or 'full_attention' per layer: the config's list, else every
    `full_attention_interval`-th layer full (transformers' default, 4)."""
    raw = config.raw
    types = raw.get("layer_types")
    if types:
        return list(types)[: config.num_layers]
    interval = int(raw.get("full_attention_interval", 4))
    return [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention"
        for i in range(config.num_layers)
    ]


class GatedAttention(nn.Module):
    """Full attention with QK norm, partial rotary and a sigmoid output gate."""

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        attention: PagedAttentionBackend,
        prefix: str,
    ) -> None:
        super().__init__()
        head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            head_dim,
            config.num_heads,
            config.num_kv_heads,
            config.qkv_bias,
            parallel,
            config.weight_format(
                [f"{prefix}.{name}" for name in ("q_proj", "k_proj", "v_proj")],
                config.hidden_size,
            ),
            query_factor=2,
        )
        heads = self.qkv_proj.heads
        self.num_heads, self.num_kv_heads = heads.num_q, heads.num_kv
        self.head_dim, self.rotary_dim = head_dim, config.rotary_dim
        input_range = (heads.q_start * head_dim, heads.num_q * head_dim)
        self.o_proj = RowParallelLinear(
            config.num_heads * head_dim,
            config.hidden_size,
            config.o_proj_bias,
            parallel,
            input_range=input_range,
            weight_format=config.weight_format(
                [f"{prefix}.o_proj"], input_range[1], input_range[0], config.num_heads * head_dim
            ),
        )
        self.q_norm = ZeroCentredRMSNorm(head_dim, config.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(head_dim, config.rms_norm_eps)
        self.attn = PagedAttention(
            self.num_heads,
            self.num_kv_heads,
            head_dim,
            head_dim**-0.5,
            attention,
            first_head=heads.q_start,
        )

    def forward(
        self, angles: RopeAngles, hidden: torch.Tensor, metadata: StepMetadata
    ) -> torch.Tensor:
        return self.gated(angles, hidden, metadata)

    def gated(
        self,
        angles: RopeAngles,
        hidden: torch.Tensor,
        metadata: StepMetadata,
        selection: Any = None,
    ) -> torch.Tensor:
        """The attention; with a `selection` (Qwen4-Exp's indexer), over the selected tokens."""
        tokens = hidden.shape[0]
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(hidden)
        query_gate = qkv[:, : 2 * heads * dim].view(tokens, heads, 2 * dim)
        query, gate = query_gate[..., :dim], query_gate[..., dim:]
        kv = qkv[:, 2 * heads * dim :].view(tokens, 2 * kv_heads, dim)
        q = self._rotate(self.q_norm(query), angles)
        k = self._rotate(self.k_norm(kv[:, :kv_heads]), angles)
        if selection is None:
            out = self.attn(q, k, kv[:, kv_heads:], metadata)  # [T, H, D]
        else:
            out = self.attn(q, k, kv[:, kv_heads:], metadata, selection=selection)
        out = out * torch.sigmoid(gate)
        return self.o_proj(out.reshape(tokens, heads * dim))

    def _rotate(self, x: torch.Tensor, angles: RopeAngles) -> torch.Tensor:
        rotated = apply_rotary(x[..., : self.rotary_dim], angles)
        return torch.cat((rotated, x[..., self.rotary_dim :]), dim=-1)


def qwen3_next_mlp(
    config: ModelConfig, parallel: ParallelContext, index: int, prefix: str
) -> nn.Module:
    spec = qwen3_moe_spec(config.raw)
    if not spec.is_sparse(index):
        return DecoderMLP(config, parallel, prefix)
    width = int(config.raw["shared_expert_intermediate_size"])
    shared = DecoderMLP(config, parallel, f"{prefix}.shared_expert", width) if width else None
    experts = packed_experts(config, parallel, spec, prefix)
    return SparseMoeBlock(
        spec, config.hidden_size, parallel, shared, experts=experts, shared_gate=shared is not None
    )


def skip_mtp(name: str) -> str | None:
    """A checkpoint tensor's name, None for the multi-token-prediction layers' (`mtp.*`)."""
    return None if name.startswith("mtp.") else name


class Qwen3NextForCausalLM(LlamaForCausalLM):
    checkpoint_target = staticmethod(expert_target)
    checkpoint_name = staticmethod(skip_mtp)
    build_mlp = staticmethod(qwen3_next_mlp)
    split_projections = False  # Qwen3.5: separate in_proj_qkv / z / b / a
    mtp_names = staticmethod(qwen_mtp_names)
    mtp_norm = ZeroCentredRMSNorm

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        max_position: int,
        attention: PagedAttentionBackend,
    ) -> None:
        self._state_backend = LinearStateBackend(_backend_device(attention))
        super().__init__(config, parallel, max_position, attention)
        self.model.norm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)

    def build_layer(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        attention: Any,
        index: int,
        prefix: str,
    ) -> nn.Module:
        mlp = self.build_mlp(config, parallel, index, f"{prefix}.mlp")
        if layer_types(config)[index] == "linear_attention":
            mixer = GatedDeltaNet(
                config,
                parallel,
                self._state_backend,
                f"{prefix}.linear_attn",
                split=self.split_projections,
            )
            return DecoderLayer(config, mixer, mlp, "linear_attn", ZeroCentredRMSNorm)
        attn = GatedAttention(config, parallel, attention, f"{prefix}.self_attn")
        return DecoderLayer(config, attn, mlp, norm=ZeroCentredRMSNorm)

    def build_mtp_block(
        self, config: ModelConfig, parallel: ParallelContext, attention: Any, prefix: str
    ) -> nn.Module:
        """The MTP layer's decoder block: gated full attention and the family's MLP (sparse,
        as a layer past the last is)."""
        mlp = self.build_mlp(config, parallel, config.num_layers, f"{prefix}.mlp")
        attn = GatedAttention(config, parallel, attention, f"{prefix}.self_attn")
        block = DecoderLayer(config, attn, mlp, norm=ZeroCentredRMSNorm)
        for module in block.modules():
            if isinstance(module, Experts):
                self.adapt_experts(module)
        return block

    @staticmethod
    def adapt_experts(experts: Experts) -> None:
        """What a family changes in how its experts load (Qwen3.5-MoE: stacked tensors)."""

    @classmethod
    def cache_specs(cls, config: ModelConfig, parallel: ParallelContext) -> list[CacheSpec]:
        """The full-attention layers' KV, as a Llama layer's."""
        full = layer_types(config).count("full_attention")
        return super().cache_specs(config, parallel)[:full]

    @classmethod
    def state_specs(cls, config: ModelConfig, parallel: ParallelContext) -> list[LinearStateSpec]:
        linear = layer_types(config).count("linear_attention")
        return [linear_state_spec(config, parallel)] * linear


def _backend_device(attention: Any) -> torch.device:
    return getattr(attention, "device", torch.device("cpu"))
