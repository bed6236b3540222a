"""RMSNorm, computed in float32 like the reference implementations."""

from __future__ import annotations

import torch
from torch import nn

from dgpp.kernels.rms_norm import add_rms_norm, rms_norm


class ResidualNorm(nn.Module):
    """A norm that also takes the residual add before it: `add_forward(x, residual)` returns
    (norm(x + residual), x + residual); fused where the norm has a kernel for it."""

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        summed = x + residual
        return self(summed), summed


class RMSNorm(ResidualNorm):
    """Normalised in float32 and scaled after casting back, the order transformers uses
    (`kernels.rms_norm`: Triton on CUDA, the PyTorch twin elsewhere)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return add_rms_norm(x, residual, self.weight, self.eps)


class ZeroCentredRMSNorm(ResidualNorm):
    """RMSNorm scaled by (1 + weight), the weight stored centred on zero (Qwen3-Next, Gemma):
    normalised and scaled in float32, then cast back."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = torch.rms_norm(x.float(), self.weight.shape, None, self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """RMSNorm of x, scaled, then multiplied by silu(gate) (Gated DeltaNet's output norm):
    normalised in float32, scaled after casting back, gated in float32, as transformers and
    fla do."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        normed = torch.rms_norm(x.float(), self.weight.shape, None, self.eps)
        scaled = self.weight * normed.to(x.dtype)
        return (scaled * torch.nn.functional.silu(gate.float())).to(x.dtype)
