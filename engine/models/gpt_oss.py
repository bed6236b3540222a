"""gpt-oss: a Llama-shaped decoder with biases on q/k/v/o, a learned attention sink per head,
`layer_types` alternating sliding-window (`sliding_window`) and full attention, YaRN rotary,
and a sparse MoE in every layer: a router with a bias whose top-k logits are softmaxed, experts
with biases and a clamped SwiGLU (`swiglu_alpha`, `swiglu_limit`; gate and up interleaved in
the checkpoint's fused [E, H, 2I] tensors). The released checkpoints keep the experts in MXFP4
(`quant_method: mxfp4`), which dgpp serves packed (`layers.mxfp4_experts`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.configuration.parallel import ParallelContext
from dgpp.engine.errors import ModelLoadError
from dgpp.engine.layers.moe import SparseMoeBlock
from dgpp.engine.layers.mxfp4_experts import Mxfp4Experts
from dgpp.engine.models.llama import LlamaForCausalLM
from dgpp.engine.models.moe_config import gpt_oss_moe_spec


def gpt_oss_attention(config: ModelConfig, index: int) -> Mapping[str, Any]:
    """Every layer has sinks; `sliding_attention` layers see the last `sliding_window` keys."""
    layer_types = config.raw.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(config.num_layers)
    ]
    kind = layer_types[index]
    if kind not in ("sliding_attention", "full_attention"):
        raise ModelLoadError(f"gpt-oss layer {index} has an unknown layer type {kind!r}")
    window = int(config.raw.get("sliding_window") or 0) if kind == "sliding_attention" else 0
    return {"has_sinks": True, "sliding_window": window or None}


def gpt_oss_target(name: str) -> tuple[str, None] | None:
    """The checkpoint keeps sinks beside the projections; dgpp keeps them in the attention."""
    if name.endswith(".self_attn.sinks"):
        return name.replace(".self_attn.sinks", ".self_attn.attn.sinks"), None
    return None


class GptOssForCausalLM(LlamaForCausalLM):
    checkpoint_target = staticmethod(gpt_oss_target)
    attention_options = staticmethod(gpt_oss_attention)

    @staticmethod
    def build_mlp(
        config: ModelConfig, parallel: ParallelContext, index: int, prefix: str
    ) -> nn.Module:
        del index, prefix
        spec = gpt_oss_moe_spec(config.raw)
        experts = None
        if config.quant_method == "mxfp4":
            experts = Mxfp4Experts(spec, config.hidden_size, parallel)
        return SparseMoeBlock(
            spec, config.hidden_size, parallel, router_name="router", experts=experts
        )
