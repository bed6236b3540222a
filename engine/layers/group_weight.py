"""The parameters of a linear layer that keeps a group-quantized weight packed
(`quant.group_codes`): `weight` holds the codes, beside it `weight_scale`, and where the format
has them `weight_zero`, `weight_global_scale` and `weight_perm`.

Scales are stored as their bit patterns (int16 for float16/bfloat16, int32 for float32):
`model.to(dtype)` converts floating parameters to the run dtype, which would round float16
scales to bfloat16; integer parameters are left alone. `group_weight` views them back.
The loaders take a whole module's `GroupWeight` (`quant.checkpoint_formats`) and copy this
rank's rows or columns of it.
"""

from __future__ import annotations

import torch
from torch import nn

from dgpp.engine.errors import ModelLoadError
from dgpp.kernels.group_codes import GroupFormat, GroupWeight

_BITS_DTYPE = {"float16": torch.int16, "bfloat16": torch.int16, "float32": torch.int32}


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def add_group_params(layer: nn.Module, rows: int, cols: int, fmt: GroupFormat) -> None:
    """Register the scale, zero, global-scale and permutation parameters of a packed
    [rows, cols] weight on `layer` (None where `fmt` has none)."""
    groups = cols // fmt.group_size
    layer.weight_scale = _param(rows, groups, dtype=_BITS_DTYPE[fmt.scale_dtype])
    layer.register_parameter(
        "weight_zero", _param(rows, groups, dtype=torch.uint8) if fmt.zeros else None
    )
    layer.register_parameter(
        "weight_global_scale",
        _param(rows, dtype=torch.int32) if fmt.global_mode is not None else None,
    )
    layer.register_parameter(
        "weight_perm", _param(cols, dtype=torch.int64) if fmt.act_order else None
    )
    layer.perm_loaded = False  # fused shards must agree on one column order


def group_weight(layer: nn.Module) -> GroupWeight:
    """The layer's packed weight, scales viewed as their float dtype."""
    fmt: GroupFormat = layer.weight_format
    global_scale = layer.weight_global_scale
    return GroupWeight(
        layer.weight,
        layer.weight_scale.view(getattr(torch, fmt.scale_dtype)),
        layer.weight_zero,
        None if global_scale is None else global_scale.view(torch.float32),
        layer.weight_perm,
    )


def _bits(scales: torch.Tensor, fmt: GroupFormat) -> torch.Tensor:
    return scales.to(getattr(torch, fmt.scale_dtype)).view(_BITS_DTYPE[fmt.scale_dtype])


def _check_parts(layer: nn.Module, loaded: GroupWeight) -> None:
    parts = (("weight_zero", loaded.zeros), ("weight_global_scale", loaded.global_scale))
    for name, tensor in parts:
        if (getattr(layer, name) is None) != (tensor is None):
            raise ModelLoadError(f"a fused shard differs from its layer in having {name}")


def _load_perm(layer: nn.Module, loaded: GroupWeight, cols: int) -> None:
    if layer.weight_perm is None:
        return
    perm = loaded.perm if loaded.perm is not None else torch.arange(cols)
    if layer.perm_loaded and not torch.equal(layer.weight_perm.data, perm):
        raise ModelLoadError("the fused shards of an act-order layer have different g_idx")
    layer.weight_perm.data.copy_(perm)
    layer.perm_loaded = True


def copy_group_rows(layer: nn.Module, loaded: GroupWeight, dst: int, src: int, size: int) -> None:
    """Rows src .. src + size of a module's weight into rows dst .. dst + size of the layer."""
    _check_parts(layer, loaded)
    fmt: GroupFormat = layer.weight_format
    layer.weight.data.narrow(0, dst, size).copy_(loaded.codes.narrow(0, src, size))
    scales = _bits(loaded.scales.narrow(0, src, size), fmt)
    layer.weight_scale.data.narrow(0, dst, size).copy_(scales)
    if loaded.zeros is not None:
        layer.weight_zero.data.narrow(0, dst, size).copy_(loaded.zeros.narrow(0, src, size))
    if loaded.global_scale is not None:
        global_scale = loaded.global_scale.to(torch.float32).narrow(0, src, size)
        layer.weight_global_scale.data.narrow(0, dst, size).copy_(global_scale.view(torch.int32))
    _load_perm(layer, loaded, layer.weight_scale.shape[1] * fmt.group_size)


def copy_group_columns(layer: nn.Module, loaded: GroupWeight, start: int, cols: int) -> None:
    """Input columns start .. start + cols of a module's weight (every row) into the layer;
    the cut lies on scale-group boundaries (`QuantSchemes.group_format` checks)."""
    _check_parts(layer, loaded)
    fmt: GroupFormat = layer.weight_format
    full_cols = loaded.codes.shape[1] * 8 // fmt.bits
    full_group = full_cols // loaded.scales.shape[1]  # == full_cols for one scale per row
    first, count = start // full_group, max(1, cols // full_group)
    code_start, code_size = fmt.code_bytes(start), fmt.code_bytes(cols)
    layer.weight.data.copy_(loaded.codes.narrow(1, code_start, code_size))
    layer.weight_scale.data.copy_(_bits(loaded.scales.narrow(1, first, count), fmt))
    if loaded.zeros is not None:
        layer.weight_zero.data.copy_(loaded.zeros.narrow(1, first, count))
    if loaded.global_scale is not None:
        layer.weight_global_scale.data.copy_(
            loaded.global_scale.to(torch.float32).view(torch.int32)
        )
    _load_perm(layer, loaded, cols)
