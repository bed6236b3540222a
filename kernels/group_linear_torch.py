"""The PyTorch twin of every group-quantized linear kernel (`kernels.group_codes`: int4, FP8,
NVFP4, MXFP4): dequantize exactly (`dequantize_group`), then `F.linear`. The CPU, Triton and FP8
kernels keep its signature and are tested against it; `kernels.group_linear` picks among them."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from dgpp.kernels.group_codes import GroupFormat, GroupWeight, dequantize_group

GroupLinearFn = Callable[[torch.Tensor, GroupWeight, GroupFormat], torch.Tensor]


def group_linear_torch(x: torch.Tensor, weight: GroupWeight, fmt: GroupFormat) -> torch.Tensor:
    """The twin: `F.linear(x[..., perm], W)` with W dequantized from its codes."""
    if weight.perm is not None:
        x = x.index_select(-1, weight.perm)
    return F.linear(x, dequantize_group(weight, fmt).to(x.dtype))
