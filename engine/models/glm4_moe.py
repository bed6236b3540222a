"""GLM-4.5 / 4.6 (and GLM-4.5-Air): a Llama-shaped decoder with q/k/v biases, partial rotary
(`partial_rotary_factor`, rotate-half on the first dims of each head), optional QK norm, and
sparse MoE blocks after the first `first_k_dense_replace` dense layers: a sigmoid router with
`e_score_correction_bias`, group-limited top-k (`n_group`, `topk_group`), scaled by
`routed_scaling_factor`, plus `n_shared_experts` always-on shared experts. The MTP layer the
checkpoints append (`num_nextn_predict_layers`) is not loaded."""

from __future__ import annotations

from torch import nn

from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.configuration.parallel import ParallelContext
from dgpp.engine.layers.moe import expert_target
from dgpp.engine.models.llama import LlamaForCausalLM
from dgpp.engine.models.moe_blocks import moe_mlp
from dgpp.engine.models.moe_config import grouped_moe_spec


def grouped_moe_block(
    config: ModelConfig, parallel: ParallelContext, index: int, prefix: str
) -> nn.Module:
    """Layer `index`'s MLP in the GLM-4.5 / DeepSeek-V3 layout: dense below
    `first_k_dense_replace`, else routed experts plus shared experts."""
    return moe_mlp(config, parallel, grouped_moe_spec(config.raw), index, prefix)


class Glm4MoeForCausalLM(LlamaForCausalLM):
    checkpoint_target = staticmethod(expert_target)
    build_mlp = staticmethod(grouped_moe_block)
