"""The routed experts of a MoE layer: the fused Triton kernel for CUDA tensors where Triton is
installed (no host synchronisation: CUDA graphs can capture it), its PyTorch twin elsewhere."""

from __future__ import annotations

import torch

from dgpp.kernels import fused_moe_torch
from dgpp.kernels.dispatch import FUSED_MOE, uses_triton


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
    w13_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """See `fused_moe_torch.fused_moe`."""
    if uses_triton(hidden, FUSED_MOE):
        from dgpp.kernels.fused_moe_triton import fused_moe_triton

        return fused_moe_triton(
            hidden, w13, w2, topk_weights, topk_ids, activation, alpha, limit, w13_bias
        )
    return fused_moe_torch.fused_moe(
        hidden, w13, w2, topk_weights, topk_ids, activation, alpha, limit, w13_bias
    )
