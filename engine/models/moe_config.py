"""The mixture-of-experts facts of a checkpoint (`dgpp.engine.layers.moe_spec`), read from its
`config.json` under each family's spellings (Qwen3-MoE, GLM-4.5, DeepSeek-V3, gpt-oss)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dgpp.engine.errors import ModelLoadError
from dgpp.engine.layers.moe_spec import MoeSpec, RouterSpec


def _require(raw: Mapping[str, Any], *keys: str) -> Any:
    for key in keys:
        if raw.get(key) is not None:
            return raw[key]
    raise ModelLoadError(f"config.json lacks {' / '.join(keys)} (a mixture-of-experts model)")


def qwen3_moe_spec(raw: Mapping[str, Any]) -> MoeSpec:
    router = RouterSpec(
        kind="softmax",
        num_experts=int(_require(raw, "num_experts", "num_local_experts")),
        top_k=int(_require(raw, "num_experts_per_tok")),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
    )
    return MoeSpec(
        router=router,
        intermediate_size=int(_require(raw, "moe_intermediate_size")),
        dense_layers=frozenset(int(i) for i in raw.get("mlp_only_layers") or ()),
        sparse_step=int(raw.get("decoder_sparse_step") or 1),
    )


def grouped_moe_spec(raw: Mapping[str, Any]) -> MoeSpec:
    """GLM-4.5/4.6, DeepSeek-V3/V3.2 and GLM-5: sigmoid router with correction bias,
    group-limited top-k, shared experts, the first `first_k_dense_replace` layers (and those
    `mlp_layer_types` calls "dense") dense."""
    num_experts = int(_require(raw, "n_routed_experts", "num_local_experts"))
    num_groups = int(raw.get("n_group") or 1)
    if num_experts % num_groups:
        raise ModelLoadError(f"n_routed_experts={num_experts} is not a multiple of n_group")
    router = RouterSpec(
        kind="sigmoid_grouped",
        num_experts=num_experts,
        top_k=int(_require(raw, "num_experts_per_tok")),
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        num_groups=num_groups,
        topk_group=int(raw.get("topk_group") or 1),
        scaling=float(raw.get("routed_scaling_factor") or 1.0),
        has_correction_bias=True,
    )
    intermediate = int(_require(raw, "moe_intermediate_size"))
    return MoeSpec(
        router=router,
        intermediate_size=intermediate,
        shared_intermediate_size=intermediate * int(raw.get("n_shared_experts") or 0),
        first_dense=int(raw.get("first_k_dense_replace") or 0),
        # DeepSeek-V3.2 and GLM-5 may spell the dense layers out (transformers 5)
        dense_layers=frozenset(
            index for index, kind in enumerate(raw.get("mlp_layer_types") or ()) if kind == "dense"
        ),
    )


def gpt_oss_moe_spec(raw: Mapping[str, Any]) -> MoeSpec:
    router = RouterSpec(
        kind="topk_softmax",
        num_experts=int(_require(raw, "num_local_experts")),
        top_k=int(_require(raw, "num_experts_per_tok", "experts_per_token")),
        has_bias=True,
    )
    return MoeSpec(
        router=router,
        intermediate_size=int(_require(raw, "intermediate_size")),
        activation="swiglu_oai",
        expert_bias=True,
        swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
    )


def deepseek_v4_moe_spec(raw: Mapping[str, Any], layer: int) -> MoeSpec:
    """DeepSeek-V4's block in layer `layer`: sqrt(softplus) scores, routed by score plus
    correction bias (`moe`) or by the token's row of a fixed table (`hash_moe`, the first
    `num_hash_layers`); clamped SwiGLU experts; `n_shared_experts` shared experts."""
    num_layers = int(_require(raw, "num_hidden_layers"))
    kinds = raw.get("mlp_layer_types") or [
        "hash_moe" if i < int(raw.get("num_hash_layers", 3)) else "moe" for i in range(num_layers)
    ]
    hashed = layer < len(kinds) and kinds[layer] == "hash_moe"  # past them: the MTP layer
    router = RouterSpec(
        kind="sqrtsoftplus",
        num_experts=int(_require(raw, "n_routed_experts", "num_local_experts")),
        top_k=int(_require(raw, "num_experts_per_tok")),
        norm_topk_prob=True,
        scaling=float(raw.get("routed_scaling_factor") or 1.0),
        has_correction_bias=not hashed,
        hash_table=int(_require(raw, "vocab_size")) if hashed else 0,
    )
    intermediate = int(_require(raw, "moe_intermediate_size"))
    return MoeSpec(
        router=router,
        intermediate_size=intermediate,
        shared_intermediate_size=intermediate * int(raw.get("n_shared_experts") or 0),
        activation="swiglu_clamp",
        swiglu_limit=float(raw.get("swiglu_limit", 10.0)),
    )
