"""RMSNorm, computed in float32 like the reference implementations."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return torch.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in float32, scale after casting back: the order transformers uses.
        normed = torch.rms_norm(x.float(), self.weight.shape, None, self.eps)
        return self.weight * normed.to(x.dtype)


class ZeroCentredRMSNorm(nn.Module):
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
