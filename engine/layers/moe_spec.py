"""What a mixture-of-experts block is made of (`MoeSpec`) and how its router picks experts
(`RouterSpec`): the layers' own description, filled from each family's `config.json` by
`dgpp.engine.models.moe_config`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

RouterKind = Literal["softmax", "sigmoid_grouped", "topk_softmax", "sqrtsoftplus"]
ExpertActivation = Literal["silu", "swiglu_oai", "swiglu_clamp"]


@dataclass(frozen=True)
class RouterSpec:
    """How a token picks its experts.

    `softmax` (Qwen3-MoE): softmax over every expert, the top k, renormalised when
    `norm_topk_prob`. `sigmoid_grouped` (GLM-4.5, DeepSeek-V3): sigmoid scores, the choice made on
    scores plus `e_score_correction_bias` among the `topk_group` best of `num_groups` groups (a
    group's score: its two best), weights the plain sigmoid scores of the chosen, renormalised
    when `norm_topk_prob`, times `scaling`. `topk_softmax` (gpt-oss): the top k logits (the router
    has a bias), softmax over those k. `sqrtsoftplus` (DeepSeek-V4): scores sqrt(softplus(logit)),
    the choice on scores plus `e_score_correction_bias`, the chosen scores renormalised, times
    `scaling`; with `hash_table` (V4's first layers) the choice is instead a fixed table's row for
    the token id (`tid2eid` [vocab, k]), the weights still the chosen scores.
    """

    kind: RouterKind
    num_experts: int
    top_k: int
    norm_topk_prob: bool = False
    num_groups: int = 1
    topk_group: int = 1
    scaling: float = 1.0
    has_bias: bool = False  # gpt-oss: a bias on the router's logits
    has_correction_bias: bool = False  # GLM/DeepSeek: e_score_correction_bias
    hash_table: int = 0  # DeepSeek-V4's hash layers: the vocabulary size of `tid2eid`


@dataclass(frozen=True)
class MoeSpec:
    """One family's sparse block: its router, expert width, shared experts and which layers are
    sparse (`is_sparse`)."""

    router: RouterSpec
    intermediate_size: int  # per expert
    shared_intermediate_size: int = 0  # 0: no shared experts
    activation: ExpertActivation = "silu"
    expert_bias: bool = False  # gpt-oss: biases on both expert projections
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    first_dense: int = 0  # layers below this index are dense (first_k_dense_replace)
    dense_layers: frozenset[int] = frozenset()  # mlp_only_layers
    sparse_step: int = 1  # decoder_sparse_step

    def is_sparse(self, layer: int) -> bool:
        if layer < self.first_dense or layer in self.dense_layers:
            return False
        return (layer + 1) % self.sparse_step == 0
