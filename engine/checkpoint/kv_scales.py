"""A checkpoint's static KV-cache scales: the per-layer `k_scale` and `v_scale` that ModelOpt
(`kv_cache_quant_algo: FP8`) and compressed-tensors (`kv_cache_scheme`, float 8-bit, one scale
per tensor) calibrate for an FP8 cache, and the legacy single `kv_scale` (both).

They are read where the checkpoint declares them (`declares_kv_scales`) and only used at
`engine.kv_cache_dtype=fp8_e4m3` (`kernels.kv_quant`: every row stored with d = the scale, not its
own maximum). A layer takes them into its `kv_scale` buffer: a module `.attn` beside the names
`<layer>.self_attn.k_scale` (compressed-tensors), `<layer>.self_attn.k_proj.k_scale` (ModelOpt)
or `<layer>.self_attn.kv_scale`. A scale with no such layer (an MLA latent cache, an MTP layer the
model does not run) is not used: those caches keep a scale per row."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from dgpp.engine.errors import ModelLoadError

log = logging.getLogger(__name__)

SUFFIXES = {"k_scale": (0,), "v_scale": (1,), "kv_scale": (0, 1)}
_PROJECTIONS = ("k_proj", "v_proj")
# What float16 (the stored row scale) holds as a normal number.
_SMALLEST, _LARGEST = 2.0**-14, 65504.0


def declares_kv_scales(quant: Mapping[str, Any] | None) -> bool:
    """Whether a checkpoint's quantization config says it carries static FP8 KV scales."""
    if not quant:
        return False
    algo = quant.get("kv_cache_quant_algo")
    if isinstance(algo, str) and algo.upper() == "FP8":
        return True
    scheme = quant.get("kv_cache_scheme")
    if not isinstance(scheme, Mapping):
        return False
    per_tensor = scheme.get("strategy", "tensor") == "tensor"
    float8 = scheme.get("type", "float") == "float" and int(scheme.get("num_bits", 8)) == 8
    if not (per_tensor and float8):
        log.warning(
            "kv_cache_scheme %s: only one float 8-bit scale per tensor is read; the KV cache "
            "keeps a scale per row",
            dict(scheme),
        )
    return per_tensor and float8


class KvScales:
    """Routes a checkpoint's scale tensors into the layers that expect them."""

    def __init__(self, model: nn.Module) -> None:
        self.layers: dict[str, torch.Tensor] = {}  # the layer's module prefix -> its buffer
        for name, module in model.named_modules():
            buffer = getattr(module, "kv_scale", None)
            if isinstance(buffer, torch.Tensor) and name.endswith(".attn"):
                self.layers[name.removesuffix(".attn")] = buffer

    def take(self, name: str, tensor: Any) -> bool:
        """Load `name` if it is a KV scale (True: consumed, used or not)."""
        owner, _, suffix = name.rpartition(".")
        if suffix not in SUFFIXES:
            return False
        parent, _, last = owner.rpartition(".")
        buffer = self.layers.get(parent if last in _PROJECTIONS else owner)
        if buffer is None:
            return True
        if not isinstance(tensor, torch.Tensor) or tensor.numel() != 1:
            shape = tuple(getattr(tensor, "shape", ()))
            raise ModelLoadError(f"{name} has shape {shape}: a static KV scale is one number")
        value = float(tensor.float().reshape(()))
        if not math.isfinite(value) or value <= 0:
            raise ModelLoadError(f"{name} is {value}: a KV scale must be finite and positive")
        if not _SMALLEST <= value <= _LARGEST:
            log.warning(
                "%s = %g is outside float16's range: that layer keeps row scales", name, value
            )
            return True
        for index in SUFFIXES[suffix]:
            buffer[index] = value
        return True
