"""FP8 GEMMs for e4m3 weights with one scale per output row (compressed-tensors / ModelOpt
per-channel and per-tensor FP8), through `torch._scaled_mm`, as FP8 checkpoints are meant to
run: activations are quantized to e4m3 per token at run time (dynamic scales, the checkpoints'
`input_activations: dynamic`), the product is accumulated by the GPU's FP8 tensor cores.

`fp8_linear_torch` is its twin: the same activation quantization, then dequantize and
`F.linear`. Block-scaled FP8 (128x128, DeepSeek-V3 / Qwen3-FP8) and GPUs without FP8 GEMMs use
the Triton dequantize-GEMM (`kernels.group_linear_triton`). `scaled_mm_usable` decides, once per
layer.
"""

from __future__ import annotations

import logging
from functools import cache

import torch
import torch.nn.functional as F

from dgpp.kernels.group_codes import GroupFormat, GroupWeight, effective_scales

log = logging.getLogger(__name__)
E4M3_MAX = 448.0
_MIN_SCALE = 1e-12  # an all-zero row of x keeps a finite scale (its codes are all zero)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row dynamic e4m3 quantization of x [M, K]: (codes, float32 scales [M, 1]) with
    x ~= codes * scales."""
    scales = (x.abs().amax(dim=-1, keepdim=True).to(torch.float32) / E4M3_MAX).clamp(min=_MIN_SCALE)
    codes = (x.to(torch.float32) / scales).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes, scales


def scaled_mm_usable(weight: GroupWeight, fmt: GroupFormat, device: torch.device) -> bool:
    """e4m3 codes with one scale per row (no zeros, order or global scale) on a device whose
    `_scaled_mm` multiplies FP8: CUDA compute capability 8.9 or newer (Ada, Hopper, Blackwell),
    or the CPU build of PyTorch (which has one; dgpp's CPU layers keep the exact kernel)."""
    if fmt.codebook != "e4m3" or weight.scales.shape[1] != 1:
        return False
    if weight.zeros is not None or weight.perm is not None or weight.global_scale is not None:
        return False
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 9) and rowwise_scaled_mm_works(
            device
        )
    return device.type == "cpu"


@cache
def rowwise_scaled_mm_works(device: torch.device) -> bool:
    """Whether this device's `_scaled_mm` takes one scale per row of each operand: tried once
    on a tiny product, since support varies by GPU and PyTorch build (some have none on
    sm_120/121, GB10 among them); where it does not, the layer keeps the Triton FP8 GEMM."""
    ones = torch.ones(16, 32, device=device).to(torch.float8_e4m3fn)
    scale_a = torch.full((16, 1), 0.5, device=device)
    scale_b = torch.full((1, 16), 2.0, device=device)
    try:
        y = torch._scaled_mm(
            ones, ones.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.float32
        )
    except (RuntimeError, NotImplementedError) as err:
        log.info(
            "no per-row FP8 _scaled_mm on %s (%s): FP8 layers use the Triton GEMM", device, err
        )
        return False
    return bool((y == 32.0).all())


def fp8_linear_scaled_mm(x: torch.Tensor, weight: GroupWeight, fmt: GroupFormat) -> torch.Tensor:
    """y = x W^T with x quantized per row to e4m3 and W's e4m3 codes as stored."""
    shape = x.shape
    codes, x_scales = quantize_rows(x.reshape(-1, shape[-1]))
    w = weight.codes.view(torch.float8_e4m3fn)  # [N, K]
    w_scales = effective_scales(weight, fmt).reshape(1, -1)  # [1, N]
    y = torch._scaled_mm(codes, w.t(), scale_a=x_scales, scale_b=w_scales, out_dtype=x.dtype)
    return y.reshape(*shape[:-1], w.shape[0])


def fp8_linear_torch(x: torch.Tensor, weight: GroupWeight, fmt: GroupFormat) -> torch.Tensor:
    """The twin: the same per-row activation quantization, dequantized, times W (dequantized)."""
    shape = x.shape
    codes, x_scales = quantize_rows(x.reshape(-1, shape[-1]))
    x_values = codes.to(torch.float32) * x_scales
    w = weight.codes.view(torch.float8_e4m3fn).to(torch.float32) * effective_scales(weight, fmt)
    return F.linear(x_values, w).to(x.dtype).reshape(*shape[:-1], w.shape[0])
