"""Prepacked dense matmuls for the linear layers: `y = x W^T (+ b)`, equal to `F.linear`.

On x86 CPUs `pack_onednn` reorders a float32 weight into oneDNN's blocked layout once;
single-row (decode) products then use both cores and run at about twice the memory bandwidth of
`F.linear`'s single-threaded GEMV (see docs/benchmarks.md). Elsewhere layers keep `F.linear`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

LinearFn = Callable[[torch.Tensor], torch.Tensor]
LinearPacker = Callable[[torch.Tensor, torch.Tensor | None], LinearFn]


def pack_onednn(weight: torch.Tensor, bias: torch.Tensor | None) -> LinearFn:
    packed = torch.ops.mkldnn._reorder_linear_weight(weight)
    linear_pointwise = torch.ops.mkldnn._linear_pointwise

    def apply(x: torch.Tensor) -> torch.Tensor:
        return linear_pointwise(x, packed, bias, "none", [], "")

    return apply


def onednn_usable(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN packing is used for float32 weights on CPUs where PyTorch was built with it."""
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def select_packer(device: torch.device, dtype: torch.dtype) -> LinearPacker | None:
    """The packer for this device and dtype, or None to keep plain `F.linear` on dense weights."""
    return pack_onednn if onednn_usable(device, dtype) else None
