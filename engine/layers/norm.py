"""RMSNorm, computed in float32 like the reference implementations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
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

    def __init__(self, hidden_size: int, eps: float, group_size: int | None = None) -> None:
        """`group_size`: normalise each group of that many features on its own (Qwen4-Exp's
        hyper-connection streams), the weight still over all of them."""
        super().__init__()
        self.eps = eps
        self.group_size = group_size
        self.weight = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self.group_size
        if group is None:
            normed = torch.rms_norm(x.float(), self.weight.shape, None, self.eps)
        else:
            grouped = x.float().unflatten(-1, (-1, group))
            normed = torch.rms_norm(grouped, (group,), None, self.eps).flatten(-2)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """RMSNorm of x, scaled, then multiplied by silu(gate) (Gated DeltaNet's output norm; or
    sigmoid(gate)):
    normalised in float32, scaled after casting back, gated in float32, as transformers and
    fla do."""

    def __init__(self, hidden_size: int, eps: float, activation: str = "silu") -> None:
        """`activation` of the gate: silu, or sigmoid (Qwen4-Exp's `output_gate_type`)."""
        super().__init__()
        if activation not in ("silu", "sigmoid"):
            raise ValueError(f"unsupported output gate activation {activation!r}")
        self.eps = eps
        self.activation = activation
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        normed = torch.rms_norm(x.float(), self.weight.shape, None, self.eps)
        scaled = self.weight * normed.to(x.dtype)
        gate = gate.float()
        activated = gate.sigmoid() if self.activation == "sigmoid" else F.silu(gate)
        return (scaled * activated).to(x.dtype)
