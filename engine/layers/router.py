"""The expert router of a mixture-of-experts block: logits from a replicated gate, then the
family's rule (`dgpp.engine.layers.moe_spec.RouterSpec`) picks each token's top-k experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dgpp.engine.layers.moe_spec import RouterSpec


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape), requires_grad=False)


class Router(nn.Module):
    """Every rank holds the whole gate (it is small) and routes identically, so the experts'
    shards on each rank see the same choice."""

    def __init__(self, spec: RouterSpec, hidden_size: int) -> None:
        super().__init__()
        self.spec = spec
        self.weight = _param(spec.num_experts, hidden_size)
        self.bias = _param(spec.num_experts) if spec.has_bias else None
        self.e_score_correction_bias = (
            _param(spec.num_experts) if spec.has_correction_bias else None
        )
        self.tid2eid = None
        if spec.hash_table:
            table = torch.zeros(spec.hash_table, spec.top_k, dtype=torch.int64)
            self.tid2eid = nn.Parameter(table, requires_grad=False)

    def forward(
        self, hidden: torch.Tensor, input_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, H] -> (weights [T, k] float32, expert ids [T, k] int64); `input_ids` [T]
        choose the experts of a hash router."""
        spec = self.spec
        if spec.kind == "sigmoid_grouped":
            logits = F.linear(hidden.float(), self.weight.float())
            return self._sigmoid_grouped(logits)
        if spec.kind == "sqrtsoftplus":
            return self._sqrtsoftplus(F.linear(hidden, self.weight).float(), input_ids)
        logits = F.linear(hidden, self.weight, self.bias)  # [T, E]
        if spec.kind == "topk_softmax":
            top, ids = torch.topk(logits, spec.top_k, dim=-1)
            return torch.softmax(top, dim=-1, dtype=top.dtype).float(), ids
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, spec.top_k, dim=-1)
        if spec.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        # The reference rounds the weights to the logits' dtype before weighting the experts.
        return weights.to(logits.dtype).float(), ids

    def _sigmoid_grouped(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        spec = self.spec
        scores = logits.sigmoid()  # [T, E]
        assert self.e_score_correction_bias is not None
        choice = scores + self.e_score_correction_bias.float()
        if spec.num_groups > 1:
            per_group = spec.num_experts // spec.num_groups
            grouped = choice.view(-1, spec.num_groups, per_group)  # [T, G, E/G]
            group_scores = grouped.topk(min(2, per_group), dim=-1)[0].sum(dim=-1)  # [T, G]
            best = torch.topk(group_scores, spec.topk_group, dim=-1, sorted=False)[1]
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
            keep = keep.unsqueeze(-1).expand(-1, -1, per_group).reshape(-1, spec.num_experts)
            choice = choice.masked_fill(~keep, float("-inf"))
        ids = torch.topk(choice, spec.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if spec.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * spec.scaling, ids

    def _sqrtsoftplus(
        self, logits: torch.Tensor, input_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.softplus(logits).sqrt()  # [T, E]
        if self.tid2eid is not None:
            assert input_ids is not None, "a hash router chooses by token id"
            ids = self.tid2eid[input_ids]
        else:
            assert self.e_score_correction_bias is not None
            choice = scores + self.e_score_correction_bias.float()
            ids = torch.topk(choice, self.spec.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.spec.scaling, ids
