"""Triton RMSNorm, alone or fused with the residual add before it: one program per row, the row
read once. Same signatures and arithmetic order as the twins in `rms_norm_torch` (normalised in
float32; a float32 row scaled in float32, any other cast back first and scaled in its dtype:
the product of two bfloat16 values is exact in float32, so rounding it once gives bfloat16's
own product)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr: tl.tensor,
    residual_ptr: tl.tensor,
    weight_ptr: tl.tensor,
    out_ptr: tl.tensor,
    summed_ptr: tl.tensor,
    eps: float,
    stride_x: int,
    stride_r: int,
    stride_o: int,
    stride_s: int,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    IS_FLOAT32: tl.constexpr,
) -> None:
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_r + cols, mask=inside, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)  # the add in x's dtype
        tl.store(summed_ptr + row * stride_s + cols, x, mask=inside)
    xf = x.to(tl.float32)
    inverse = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps)
    weight = tl.load(weight_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    if IS_FLOAT32:
        out = xf * inverse * weight
    else:
        out = (xf * inverse).to(x.dtype).to(tl.float32) * weight
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=inside)


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    assert rows.stride(-1) == 1, "rows are contiguous"
    out = torch.empty_like(rows)
    summed = torch.empty_like(rows) if residual is not None else out
    res = residual.reshape(-1, n) if residual is not None else rows
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            rows,
            res,
            weight,
            out,
            summed,
            eps,
            rows.stride(0),
            res.stride(0),
            out.stride(0),
            summed.stride(0),
            N=n,
            BLOCK=triton.next_power_of_2(n),
            HAS_RESIDUAL=residual is not None,
            IS_FLOAT32=x.dtype == torch.float32,
        )
    return out.view(x.shape), summed.view(x.shape)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, None, weight, eps)[0]


def add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch(x, residual, weight, eps)
