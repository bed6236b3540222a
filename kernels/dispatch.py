"""Which implementation serves a tensor: a Triton kernel for CUDA tensors where Triton is
installed and the kernel has not been switched off, the PyTorch twin of the same signature
everywhere else.

A kernel is switched off for the whole process by `fall_back(name, reason)`: the start-up
self-check (`dgpp.engine.selfcheck`) does it when a kernel fails to compile on the node's GPU
or breaks its tolerance against its twin. Every dispatch site names its kernel (`KERNELS`)."""

from __future__ import annotations

import importlib.util
import os
from functools import cache

import torch

# The GPU kernels the self-check proves, by the name dispatch and the metrics use.
PAGED_ATTENTION = "paged_attention"  # decode, split-K decode and prefill over the paged cache
ROPE_STORE = "rope_store"  # rotary embedding fused with the KV store
MLA_DECODE = "mla_decode"  # latent attention's decode
RMS_NORM = "rms_norm"  # RMSNorm and add + RMSNorm
SILU_AND_MUL = "silu_and_mul"
FUSED_MOE = "fused_moe"
GROUP_LINEAR = "group_linear"  # dequantize-GEMM of group-quantized weights
FP8_SCALED_MM = "fp8_scaled_mm"  # PyTorch's FP8 GEMM for per-channel FP8 weights
GATED_DELTA = "gated_delta"  # fla-core's Gated DeltaNet kernels
KIMI_DELTA = "kimi_delta"  # fla-core's Kimi Delta Attention kernels
KERNELS = (
    PAGED_ATTENTION, ROPE_STORE, MLA_DECODE, RMS_NORM, SILU_AND_MUL, FUSED_MOE, GROUP_LINEAR,
    FP8_SCALED_MM, GATED_DELTA, KIMI_DELTA,
)  # fmt: skip

_fallbacks: dict[str, str] = {}  # kernel -> why this process serves its twin instead


@cache
def has_triton() -> bool:
    """Whether Triton is installed."""
    return importlib.util.find_spec("triton") is not None


def kernel_on(name: str) -> bool:
    """Whether kernel `name` may serve (the self-check has not switched it off)."""
    return name not in _fallbacks


def fall_back(name: str, reason: str) -> None:
    """Serve kernel `name`'s PyTorch twin from now on, in this process."""
    assert name in KERNELS, name
    _fallbacks.setdefault(name, reason)


def fallbacks() -> dict[str, str]:
    """The kernels switched off in this process, with why."""
    return dict(_fallbacks)


def restore_kernels() -> None:
    """Switch every kernel back on (a new model's self-check starts from here)."""
    _fallbacks.clear()


def uses_triton(x: torch.Tensor, kernel: str) -> bool:
    """Whether `x` goes to Triton kernel `kernel` (a CUDA tensor, Triton installed, the kernel
    not switched off)."""
    return x.is_cuda and has_triton() and kernel not in _fallbacks


def float32_products(dtype: torch.dtype) -> bool:
    """Whether a Triton kernel multiplies its `tl.dot` operands in float32 (IEEE): for float32
    tensors (no TF32 rounding, as the twins), and always under Triton's interpreter, whose 16-bit
    `tl.dot` is wrong (Triton 3.9: it multiplies the raw bits)."""
    return dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"
