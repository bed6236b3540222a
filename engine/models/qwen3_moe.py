"""Qwen3-MoE: the Qwen3 decoder (per-head q/k RMSNorm) with sparse MoE blocks: a softmax
router over `num_experts`, the top `num_experts_per_tok`, renormalised when `norm_topk_prob`;
`mlp_only_layers` and `decoder_sparse_step` leave some layers dense. No shared experts."""

from __future__ import annotations

from torch import nn

from dgpp.engine.config import ModelConfig
from dgpp.engine.layers.moe import SparseMoeBlock, expert_target
from dgpp.engine.models.llama import DecoderMLP, LlamaForCausalLM
from dgpp.engine.models.moe_config import qwen3_moe_spec
from dgpp.engine.parallel import ParallelContext


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    checkpoint_target = staticmethod(expert_target)

    @staticmethod
    def build_mlp(
        config: ModelConfig, parallel: ParallelContext, index: int, prefix: str
    ) -> nn.Module:
        spec = qwen3_moe_spec(config.raw)
        if not spec.is_sparse(index):
            return DecoderMLP(config, parallel, prefix)
        return SparseMoeBlock(spec, config.hidden_size, parallel)
