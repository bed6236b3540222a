"""PyTorch twins of the RMSNorm kernels: the reference the Triton kernels are tested against and
the implementation on every device without Triton (CPU). Normalised in float32; a float32 input
is scaled in float32, any other is cast back first and scaled in its own dtype (the order
transformers uses)."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps) over the last dimension."""
    if x.dtype == torch.float32:
        return torch.rms_norm(x, weight.shape, weight, eps)
    normed = torch.rms_norm(x.float(), weight.shape, None, eps)
    return weight * normed.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): a residual connection and the next norm."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed
