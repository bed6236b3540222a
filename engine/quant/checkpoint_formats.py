"""Quantized checkpoint tensors of one linear module, converted exactly into the packed form of
`quant.group_codes` (a full [out, in] weight; layers cut their shard from it).

Layouts, as their writers store them (W is [N = out, K = in]):
- GPTQ (AutoGPTQ, GPTQModel, AutoRound `auto_round:auto_gptq`): `qweight` int32 [K/8, N], eight
  4-bit codes per word along K, lowest nibble first; `qzeros` int32 [groups, N/8] packed along N;
  `scales` float16 [groups, N]; optional `g_idx` int32 [K] (act order). W = (q - z) * s, where
  format v1 (`checkpoint_format: gptq`, the default) stores z - 1.
- AWQ GEMM (AutoAWQ, AutoRound `auto_round:auto_awq`): `qweight` int32 [K, N/8] and `qzeros`
  [groups, N/8], nibble j of a word holding column 8w + (0, 2, 4, 6, 1, 3, 5, 7)[j];
  `scales` [groups, N]. W = (q - z) * s.
- compressed-tensors `pack-quantized` int4: `weight_packed` int32 [N, K/8] (codes q + 8, lowest
  nibble first), `weight_scale` [N, groups], optional `weight_zero_point` int32 [N/8, groups]
  packed along N. W = (q - zp) * s.
- FP8 e4m3: `weight` float8_e4m3fn [N, K] with `weight_scale_inv` (the `fp8` method: blocks of
  `weight_block_size`; DeepSeek-V4 names it `scale` and stores E8M0 powers of two) or
  `weight_scale` (compressed-tensors / ModelOpt: per tensor, per channel or per block).
  W = w * s.
- NVFP4: `weight_packed` (compressed-tensors) or `weight` (ModelOpt) uint8 [N, K/2], e2m1 codes,
  even column in the low nibble; `weight_scale` float8_e4m3fn [N, K/16]; one global scale:
  compressed-tensors W = q * (s / weight_global_scale), ModelOpt W = q * (s * weight_scale_2).
- MXFP4 (compressed-tensors `mxfp4-pack-quantized`): `weight_packed` uint8 [N, K/2] e2m1 codes,
  `weight_scale` uint8 e8m0 [N, K/32]: W = q * 2^(e - 127).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from dgpp.engine.errors import ModelLoadError
from dgpp.engine.quant.quant_schemes import LayerScheme
from dgpp.kernels.group_codes import GroupFormat, GroupWeight, dequantize_group, pack_nibbles

_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # the eight nibbles of an int32
_AWQ_COLUMNS = (0, 4, 1, 5, 2, 6, 3, 7)  # column offset c sits in nibble _AWQ_COLUMNS[c]


def _nibbles_along_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R/8, C] -> [R * ... , C] codes: word row i holds rows 8i .. 8i + 7."""
    values = (packed.unsqueeze(1) >> _SHIFTS.view(1, 8, 1)) & 0xF  # [R/8, 8, C]
    return values.reshape(-1, packed.shape[-1])


def _nibbles_along_cols(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C/8] -> [R, C] codes, lowest nibble first."""
    return ((packed.unsqueeze(-1) >> _SHIFTS) & 0xF).reshape(packed.shape[0], -1)


def _awq_cols(packed: torch.Tensor) -> torch.Tensor:
    values = (packed.unsqueeze(-1) >> _SHIFTS) & 0xF  # [R, C/8, 8] in nibble order
    return values[..., list(_AWQ_COLUMNS)].reshape(packed.shape[0], -1)


def _e4m3_scales(scale: torch.Tensor) -> torch.Tensor:
    """e4m3 scales as float16: every e4m3 value is a float16 value, so this is exact."""
    return scale.to(torch.float16)


def _e8m0_scales(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 exponents as bfloat16 powers of two (exact: bfloat16 has float32's exponent range)."""
    return torch.exp2(scale.to(torch.float32) - 127.0).to(torch.bfloat16)


def _row_scales(scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """FP8 scales as one per row and column group: per tensor [] / [1] -> [N, 1], per channel
    [N, 1] as is, per block [ceil(N/b0), ceil(K/b1)] -> [N, ceil(K/b1)]."""
    scale = scale.to(torch.float32)
    if scale.numel() == 1:
        return scale.reshape(1, 1).expand(rows, 1).contiguous()
    if scale.shape == (rows, 1):
        return scale
    block_rows, block_cols = block
    if scale.dim() != 2 or scale.shape[1] * block_cols < cols:
        shape = tuple(scale.shape)
        raise ModelLoadError(f"FP8 scale of shape {shape} does not fit a [{rows}, {cols}] weight")
    return scale.repeat_interleave(block_rows, dim=0)[:rows].contiguous()


def _act_order(codes: torch.Tensor, g_idx: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """The column order that makes act-order groups contiguous, or None when already so."""
    cols = codes.shape[1]
    g_idx = g_idx.to(torch.int64)
    if torch.equal(g_idx, torch.arange(cols) // group_size):
        return None
    counts = torch.bincount(g_idx, minlength=cols // group_size)
    if counts.numel() != cols // group_size or bool((counts != group_size).any()):
        raise ModelLoadError("g_idx does not assign every group exactly group_size columns")
    return torch.argsort(g_idx, stable=True)


def to_group_weight(
    scheme: LayerScheme, tensors: Mapping[str, torch.Tensor], rows: int, cols: int
) -> GroupWeight:
    """The packed form of one module's checkpoint tensors (suffix -> tensor), [rows, cols]."""
    layout = scheme.layout
    perm = None
    global_scale = None
    zeros = None
    if layout in ("gptq", "awq"):
        if layout == "gptq":
            codes = _nibbles_along_rows(tensors["qweight"]).t()
            zeros = _nibbles_along_cols(tensors["qzeros"]) + (1 if scheme.zero_offset else 0)
        else:
            codes = _awq_cols(tensors["qweight"]).t()
            zeros = _awq_cols(tensors["qzeros"])
        zeros = zeros[:, :rows].t().to(torch.uint8).contiguous()
        scales = tensors["scales"].t().contiguous()
        if "g_idx" in tensors and scheme.act_order:
            perm = _act_order(codes, tensors["g_idx"], scheme.group_format(cols).group_size)
            if perm is not None:
                codes = codes[:, perm]
        codes = pack_nibbles(codes.contiguous())
    elif layout == "ct-int4":
        codes = pack_nibbles(_nibbles_along_cols(tensors["weight_packed"])[:, :cols])
        scales = tensors["weight_scale"]
        if "weight_zero_point" in tensors:
            # stored as zp + 8, like the codes: (q + 8) - (zp + 8) = q - zp
            zeros = _nibbles_along_rows(tensors["weight_zero_point"])[:rows]
            zeros = zeros.to(torch.uint8).contiguous()
    elif layout == "fp8":
        weight = tensors["weight"]
        codes = weight.contiguous().view(torch.uint8)
        scales = _row_scales(tensors[scheme.scale_name], rows, cols, scheme.block)
    elif layout == "nvfp4":
        codes = tensors[scheme.codes_name].contiguous()
        scales = _e4m3_scales(tensors["weight_scale"])
        global_name = "weight_global_scale" if scheme.global_mode == "div" else "weight_scale_2"
        global_scale = tensors[global_name].to(torch.float32).reshape(1).expand(rows).contiguous()
    elif layout == "mxfp4":
        codes = tensors["weight_packed"].contiguous()
        scales = _e8m0_scales(tensors["weight_scale"])
    else:
        raise ModelLoadError(f"unknown quantized layout {layout!r}")
    weight = GroupWeight(codes, scales.contiguous(), zeros, global_scale, perm)
    _check_shapes(weight, scheme.group_format(cols), rows, cols)
    return weight


def _check_shapes(weight: GroupWeight, fmt: GroupFormat, rows: int, cols: int) -> None:
    groups = cols // fmt.group_size
    expected = {
        "codes": (weight.codes, (rows, fmt.code_bytes(cols))),
        "scales": (weight.scales, (rows, groups)),
        "zeros": (weight.zeros, (rows, groups)),
    }
    for name, (tensor, shape) in expected.items():
        if tensor is not None and tuple(tensor.shape) != shape:
            raise ModelLoadError(
                f"quantized {name} of shape {tuple(tensor.shape)}; a [{rows}, {cols}] weight "
                f"in {fmt.describe()} needs {shape}"
            )


def full_shape(scheme: LayerScheme, tensors: Mapping[str, torch.Tensor]) -> tuple[int, int]:
    """[out, in] of the module's weight, from its packed tensors."""
    layout = scheme.layout
    if layout == "gptq":
        words, rows = tensors["qweight"].shape
        return rows, words * 8
    if layout == "awq":
        cols, words = tensors["qweight"].shape
        return words * 8, cols
    if layout == "ct-int4":
        rows, words = tensors["weight_packed"].shape
        return rows, words * 8
    if layout == "fp8":
        rows, cols = tensors["weight"].shape
        return rows, cols
    rows, half = tensors[scheme.codes_name].shape
    return rows, half * 2


@dataclass(frozen=True)
class PackedModule:
    """One quantized module's weight, converted: loaded packed, or `dense()` for a layer that
    keeps the run dtype (a fused layer whose modules differ, an LM head)."""

    name: str
    scheme: LayerScheme
    weight: GroupWeight
    cols: int

    def dense(self) -> torch.Tensor:
        """float32 [out, in] in the checkpoint's column order."""
        values = dequantize_group(self.weight, self.scheme.group_format(self.cols))
        if self.weight.perm is None:
            return values
        restored = torch.empty_like(values)
        restored[:, self.weight.perm] = values
        return restored


def packed_module(
    name: str, scheme: LayerScheme, tensors: Mapping[str, torch.Tensor]
) -> PackedModule:
    """Convert module `name`'s checkpoint tensors (suffix -> tensor); errors name the module."""
    try:
        rows, cols = full_shape(scheme, tensors)
        return PackedModule(name, scheme, to_group_weight(scheme, tensors, rows, cols), cols)
    except ModelLoadError as err:
        raise ModelLoadError(f"quantized module {name}: {err.message}") from None
    except (RuntimeError, ValueError, IndexError) as err:  # shapes that do not fit together
        raise ModelLoadError(f"quantized module {name} has inconsistent tensors: {err}") from None
