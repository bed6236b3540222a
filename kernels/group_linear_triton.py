"""Triton kernel for linear layers on group-quantized weights (`kernels.group_codes`).

`group_linear_triton(x, weight, fmt)` computes `x[..., perm] @ W^T` with W dequantized on the fly
from its packed codes: int4, uint4 (with or without zero codes), e2m1 (NVFP4, MXFP4) and e4m3.
Its PyTorch twin is `kernels.group_linear_torch`; the two agree up to the order of
the float32 sums.

Each program computes a [BLOCK_M, BLOCK_N] tile of the output. Along K it loads a
[BLOCK_M, BLOCK_K] tile of x and the codes of a [BLOCK_N, BLOCK_K] tile of W (4-bit codes as
[BLOCK_N, BLOCK_K / 2] bytes, split into nibbles and interleaved back into column order), decodes
them through the codebook's float32 lookup table, subtracts the zero codes and multiplies by the
effective scales (gathered per column through `k // GROUP`, so BLOCK_K and the group size need
not divide each other), rounds the tile to x's dtype as the twin does, and accumulates
`tl.dot(x, W^T)` in float32 ("ieee" precision for float32 x).
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl

from dgpp.kernels.group_codes import GroupFormat, GroupWeight, codebook_values

_TORCH_TO_TL = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def _group_linear_kernel(
    x_ptr: tl.tensor,
    codes_ptr: tl.tensor,
    scales_ptr: tl.tensor,
    zeros_ptr: tl.tensor,
    global_ptr: tl.tensor,
    lut_ptr: tl.tensor,
    out_ptr: tl.tensor,
    M: int,
    N: int,
    K: int,
    stride_xm: int,
    stride_xk: int,
    stride_cn: int,
    stride_sn: int,
    stride_zn: int,
    stride_om: int,
    stride_on: int,
    GROUP: tl.constexpr,
    BITS: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_GLOBAL: tl.constexpr,
    GLOBAL_DIV: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
) -> None:
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    if HAS_GLOBAL:
        global_scale = tl.load(global_ptr + offs_n, mask=mask_n, other=1.0).to(tl.float32)[:, None]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x_tile = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )

        # Codes of the [BLOCK_N, BLOCK_K] tile of W, in column order.
        if BITS == 4:
            offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            packed = tl.load(
                codes_ptr + offs_n[:, None] * stride_cn + offs_b[None, :],
                mask=mask_n[:, None] & (offs_b < K // 2)[None, :],
                other=0,
            )
            codes = tl.interleave(packed & 0x0F, packed >> 4).to(tl.int32)
        else:
            codes = tl.load(
                codes_ptr + offs_n[:, None] * stride_cn + offs_k[None, :],
                mask=mask_n[:, None] & mask_k[None, :],
                other=0,
            ).to(tl.int32)
        values = tl.load(lut_ptr + codes)

        # Per-column group index: no assumption about how BLOCK_K and GROUP relate.
        mask_w = mask_n[:, None] & mask_k[None, :]
        groups = offs_k // GROUP
        scales = tl.load(
            scales_ptr + offs_n[:, None] * stride_sn + groups[None, :], mask=mask_w, other=0.0
        ).to(tl.float32)
        if HAS_GLOBAL:
            # As `effective_scales`: an exactly rounded division, not an approximate one.
            scales = tl.math.div_rn(scales, global_scale) if GLOBAL_DIV else scales * global_scale
        if HAS_ZEROS:
            zeros = tl.load(
                zeros_ptr + offs_n[:, None] * stride_zn + groups[None, :], mask=mask_w, other=0
            ).to(tl.float32)
            values = values - zeros
        w_tile = (values * scales).to(DOT_DTYPE)

        if IEEE:
            acc = tl.dot(x_tile, tl.trans(w_tile), acc, input_precision="ieee")
        else:
            acc = tl.dot(x_tile, tl.trans(w_tile), acc)

    tl.store(
        out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
        acc.to(out_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )


@cache
def _lookup_table(codebook: str, device: torch.device) -> torch.Tensor:
    """The codebook's float32 values on `device`, copied there once."""
    return codebook_values(codebook).to(device)


def _block_m(m: int) -> int:
    """The M tile: 16 (the smallest `tl.dot` takes) for decode, larger for prefill."""
    if m <= 16:
        return 16
    return 32 if m <= 32 else 64


def group_linear_triton(x: torch.Tensor, weight: GroupWeight, fmt: GroupFormat) -> torch.Tensor:
    """`F.linear(x[..., perm], W)` with W dequantized from its codes inside the kernel."""
    if x.dtype not in _TORCH_TO_TL:
        raise TypeError(f"group_linear_triton takes float32, float16 or bfloat16 x, not {x.dtype}")
    if fmt.bits not in (4, 8):
        raise ValueError(f"unsupported code width {fmt.bits}")
    rows = weight.codes.shape[0]
    cols = weight.codes.shape[1] * 8 // fmt.bits
    if x.shape[-1] != cols:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {cols}")
    if cols % fmt.group_size or weight.scales.shape != (rows, cols // fmt.group_size):
        raise ValueError(f"scales {tuple(weight.scales.shape)} do not fit {fmt.describe()}")
    if weight.perm is not None:
        x = x.index_select(-1, weight.perm)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, cols)
    m = x2.shape[0]
    out = torch.empty((m, rows), dtype=x.dtype, device=x.device)
    if m == 0 or rows == 0:
        return out.view(*lead, rows)

    codes = weight.codes if weight.codes.stride(-1) == 1 else weight.codes.contiguous()
    scales = weight.scales if weight.scales.stride(-1) == 1 else weight.scales.contiguous()
    zeros = weight.zeros
    if zeros is not None and zeros.stride(-1) != 1:
        zeros = zeros.contiguous()
    global_scale = weight.global_scale  # one per output row (a scalar is broadcast)
    if global_scale is not None:
        global_scale = global_scale.to(torch.float32).reshape(-1).expand(rows).contiguous()
    lut = _lookup_table(fmt.codebook, x.device)

    block_m, block_n, block_k = _block_m(m), 64, 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(rows, block_n))
    _group_linear_kernel[grid](
        x2,
        codes,
        scales,
        zeros if zeros is not None else codes,
        global_scale if global_scale is not None else scales,
        lut,
        out,
        m,
        rows,
        cols,
        x2.stride(0),
        x2.stride(1),
        codes.stride(0),
        scales.stride(0),
        zeros.stride(0) if zeros is not None else 0,
        out.stride(0),
        out.stride(1),
        GROUP=fmt.group_size,
        BITS=fmt.bits,
        HAS_ZEROS=zeros is not None,
        HAS_GLOBAL=global_scale is not None,
        GLOBAL_DIV=fmt.global_mode == "div",
        DOT_DTYPE=_TORCH_TO_TL[x.dtype],
        IEEE=x.dtype == torch.float32,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4,
    )
    return out.view(*lead, rows)
