"""Qwen3-MoE: the Qwen3 decoder (per-head q/k RMSNorm) with sparse MoE blocks: a softmax
router over `num_experts`, the top `num_experts_per_tok`, renormalised when `norm_topk_prob`;
`mlp_only_layers` and `decoder_sparse_step` leave some layers dense. No shared experts."""

from __future__ import annotations

from torch import nn

from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.configuration.parallel import ParallelContext
from dgpp.engine.layers.moe import expert_target
from dgpp.engine.models.llama import LlamaForCausalLM
from dgpp.engine.models.moe_blocks import moe_mlp
from dgpp.engine.models.moe_config import qwen3_moe_spec


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    checkpoint_target = staticmethod(expert_target)

    @staticmethod
    def build_mlp(
        config: ModelConfig, parallel: ParallelContext, index: int, prefix: str
    ) -> nn.Module:
        return moe_mlp(config, parallel, qwen3_moe_spec(config.raw), index, prefix)
