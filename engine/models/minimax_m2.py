"""MiniMax-M2 (`MiniMaxM2ForCausalLM`): a Llama-shaped decoder whose every layer is full
attention and sparse MoE, with these differences:

- QK norm over the whole projection: one RMSNorm over all query heads together (and one over all
  key heads), not per head. Under tensor parallelism each rank holds some heads, so the ranks
  add their sums of squares (one all-reduce of two numbers per token and layer) before
  normalising their own slice with their slice of the weight.
- Partial rotary: `rotary_dim` (or `partial_rotary_factor`) of each head's dims.
- The router: sigmoid scores, top k chosen by score plus `e_score_correction_bias`, weights the
  chosen scores renormalised (GLM-4.5's router with one group and no scaling); no shared
  experts; every expert `intermediate_size` wide.
- Checkpoint names as released (Mixtral's): `block_sparse_moe.gate`, `block_sparse_moe.
  e_score_correction_bias`, experts' `w1` (gate), `w3` (up) and `w2` (down).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from dgpp.engine.backends.base import StepMetadata
from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.configuration.parallel import ParallelContext
from dgpp.engine.errors import ModelLoadError
from dgpp.engine.layers.moe import expert_target
from dgpp.engine.layers.moe_spec import MoeSpec, RouterSpec
from dgpp.engine.layers.rotary import RopeAngles
from dgpp.engine.models.llama import DecoderAttention, LlamaForCausalLM
from dgpp.engine.models.moe_blocks import moe_mlp

_EXPERT_NAMES = ((".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj."))


def minimax_checkpoint_name(name: str) -> str | None:
    """The released (Mixtral-style) names as the shared MoE block's."""
    name = name.replace(
        ".block_sparse_moe.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"
    )
    name = name.replace(".block_sparse_moe.", ".mlp.")
    if ".mlp.experts." in name:
        for old, new in _EXPERT_NAMES:
            name = name.replace(old, new)
    return name


def minimax_m2_spec(raw: Mapping[str, Any]) -> MoeSpec:
    try:
        router = RouterSpec(
            kind="sigmoid_grouped",
            num_experts=int(raw["num_local_experts"]),
            top_k=int(raw["num_experts_per_tok"]),
            norm_topk_prob=True,
            has_correction_bias=True,
        )
        return MoeSpec(router=router, intermediate_size=int(raw["intermediate_size"]))
    except KeyError as missing:
        raise ModelLoadError(f"config.json lacks {missing} (MiniMax-M2's experts)") from None


class SlicedNorm(nn.Module):
    """This rank's slice (`start`, `width` features) of a norm's weight over `full` features."""

    def __init__(self, full: int, start: int, width: int) -> None:
        super().__init__()
        self.full, self.start = full, start
        self.weight = nn.Parameter(torch.ones(width), requires_grad=False)
        self.weight.weight_loader = self.load  # type: ignore[attr-defined]

    def load(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if tuple(loaded.shape) != (self.full,):
            raise ModelLoadError(
                f"a QK norm weight of shape {tuple(loaded.shape)}, expected {(self.full,)}"
            )
        param.data.copy_(loaded[self.start : self.start + param.shape[0]])


class WholeQKNormAttention(DecoderAttention):
    """Attention whose q and k are RMS-normalised over all their heads at once."""

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        attention: Any,
        prefix: str,
    ) -> None:
        super().__init__(dataclasses.replace(config, qk_norm=False), parallel, attention, prefix)
        heads, dim = self.qkv_proj.heads, config.head_dim
        self.parallel, self.eps = parallel, config.rms_norm_eps
        self.q_norm = SlicedNorm(config.num_heads * dim, heads.q_start * dim, heads.num_q * dim)
        self.k_norm = SlicedNorm(
            config.num_kv_heads * dim, heads.kv_start * dim, heads.num_kv * dim
        )
        # Key heads held by several ranks (more ranks than key heads) count once in the sum.
        self.k_copies = parallel.tp_size * heads.num_kv / config.num_kv_heads

    def forward(
        self, angles: RopeAngles, hidden: torch.Tensor, metadata: StepMetadata
    ) -> torch.Tensor:
        tokens, dim = hidden.shape[0], self.head_dim
        q_width, kv_width = self.num_heads * dim, self.num_kv_heads * dim
        q, k, v = self.qkv_proj(hidden).split([q_width, kv_width, kv_width], dim=-1)
        q, k = self._normed(q, k)
        q = self._rotate(q.reshape(tokens, self.num_heads, dim), angles)
        k = self._rotate(k.reshape(tokens, self.num_kv_heads, dim), angles)
        out = self.attn(q, k, v.reshape(tokens, self.num_kv_heads, dim), metadata)
        return self.o_proj(out.reshape(tokens, q_width))

    def _normed(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As transformers' RMSNorm over the whole projection: float32 statistics over every
        rank's heads, the result cast back and scaled by the weight."""
        qf, kf = q.float(), k.float()
        sums = torch.stack((qf.square().sum(-1), kf.square().sum(-1) / self.k_copies), dim=-1)
        if self.parallel.tp_size > 1:
            sums = self.parallel.all_reduce(sums)
        q_scale = torch.rsqrt(sums[:, :1] / self.q_norm.full + self.eps)
        k_scale = torch.rsqrt(sums[:, 1:] / self.k_norm.full + self.eps)
        q = self.q_norm.weight * (qf * q_scale).to(q.dtype)
        k = self.k_norm.weight * (kf * k_scale).to(k.dtype)
        return q, k


def minimax_mlp(
    config: ModelConfig, parallel: ParallelContext, index: int, prefix: str
) -> nn.Module:
    return moe_mlp(config, parallel, minimax_m2_spec(config.raw), index, prefix)


class MiniMaxM2ForCausalLM(LlamaForCausalLM):
    checkpoint_name = staticmethod(minimax_checkpoint_name)
    checkpoint_target = staticmethod(expert_target)
    build_mlp = staticmethod(minimax_mlp)

    @classmethod
    def build_attention(
        cls, config: ModelConfig, parallel: ParallelContext, attention: Any, index: int, prefix: str
    ) -> nn.Module:
        del index
        return WholeQKNormAttention(config, parallel, attention, f"{prefix}.self_attn")
