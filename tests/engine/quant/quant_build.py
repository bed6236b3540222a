"""Quantize a tiny transformers model's linear layers into each checkpoint format dgpp reads,
written as its producers write it, with the reference float32 weights each format's published
formula gives (computed here from the integer codes and scales, before any packing).

compressed-tensors checkpoints are packed by compressed-tensors' own compressors; GPTQ, AWQ,
the `fp8` method and ModelOpt NVFP4 by the layouts their writers document (AutoGPTQ / AutoAWQ /
DeepSeek-V3 / ModelOpt), since those writers need a GPU or calibration data.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble j holds column offset AWQ_ORDER[j]

Tensors = dict[str, torch.Tensor]
Quantizer = Callable[[str, torch.Tensor, torch.Generator], tuple[Tensors, torch.Tensor]]


def _int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words < 2**32 -> int32 with the same bits."""
    return torch.from_numpy(words.numpy().astype(np.uint32).view(np.int32))


def pack_rows(codes: torch.Tensor) -> torch.Tensor:
    """[R, C] 4-bit codes -> int32 [R/8, C]: row 8i + j in nibble j of word row i."""
    words = torch.zeros(codes.shape[0] // 8, codes.shape[1], dtype=torch.int64)
    for j in range(8):
        words |= codes[j::8].to(torch.int64) << (4 * j)
    return _int32(words)


def pack_cols(codes: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """[R, C] 4-bit codes -> int32 [R, C/8]: nibble j holds column 8w + order[j]."""
    words = torch.zeros(codes.shape[0], codes.shape[1] // 8, dtype=torch.int64)
    for j, column in enumerate(order):
        words |= codes[:, column::8].to(torch.int64) << (4 * j)
    return _int32(words)


def int4_codes(
    weight: torch.Tensor, group: int, perm: torch.Tensor | None = None, min_zero: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 of [N, K] in groups of `group` columns (of `perm`'s order when given):
    codes q [N, K], zeros z [N, G], float16 scales s [N, G], reference (q - z) * s [N, K]."""
    rows, cols = weight.shape
    order = perm if perm is not None else torch.arange(cols)
    grouped = weight[:, order].view(rows, cols // group, group)
    low, high = grouped.amin(-1).clamp(max=0), grouped.amax(-1).clamp(min=0)
    scales = ((high - low) / 15).clamp(min=1e-4).to(torch.float16)
    s = scales.float().unsqueeze(-1)
    zeros = torch.round(-low / scales.float()).clamp(min_zero, 15).to(torch.int64)
    codes = torch.clamp(torch.round(grouped / s) + zeros.unsqueeze(-1), 0, 15).to(torch.int64)
    values = ((codes - zeros.unsqueeze(-1)).float() * s).view(rows, cols)
    codes = codes.view(rows, cols)
    reference = torch.empty_like(values)
    reference[:, order] = values
    restored = torch.empty_like(codes)
    restored[:, order] = codes
    return restored, zeros, scales, reference


def gptq(group: int, act_order: bool = False) -> Quantizer:
    def quantize(
        name: str, weight: torch.Tensor, gen: torch.Generator
    ) -> tuple[Tensors, torch.Tensor]:
        cols = weight.shape[1]
        perm = _shared_perm(name, cols, gen) if act_order else None
        codes, zeros, scales, reference = int4_codes(weight, group, perm, min_zero=1)
        g_idx = torch.arange(cols, dtype=torch.int32) // group
        if perm is not None:
            g_idx[perm] = (torch.arange(cols, dtype=torch.int32) // group).clone()
        tensors = {
            "qweight": pack_rows(codes.t().contiguous()),
            "qzeros": pack_cols((zeros - 1).t().contiguous()),  # format v1: zero - 1
            "scales": scales.t().contiguous(),
            "g_idx": g_idx,
        }
        return tensors, reference

    return quantize


_PERMS: dict[tuple[str, int], torch.Tensor] = {}


def _shared_perm(name: str, cols: int, gen: torch.Generator) -> torch.Tensor:
    """One act order per input: q/k/v (and gate/up) see the same activations, so GPTQ gives
    them the same column order."""
    layer = name.rsplit(".", 2)[0]
    key = (
        layer
        + (
            ".qkv"
            if name.split(".")[-1] in ("q_proj", "k_proj", "v_proj")
            else ".gu"
            if name.split(".")[-1] in ("gate_proj", "up_proj")
            else name
        ),
        cols,
    )
    if key not in _PERMS:
        _PERMS[key] = torch.randperm(cols, generator=gen)
    return _PERMS[key]


def awq(group: int) -> Quantizer:
    def quantize(
        name: str, weight: torch.Tensor, gen: torch.Generator
    ) -> tuple[Tensors, torch.Tensor]:
        codes, zeros, scales, reference = int4_codes(weight, group)
        tensors = {
            "qweight": pack_cols(codes.t().contiguous(), AWQ_ORDER),
            "qzeros": pack_cols(zeros.t().contiguous(), AWQ_ORDER),
            "scales": scales.t().contiguous(),
        }
        return tensors, reference

    return quantize


def fp8_block(block: tuple[int, int]) -> Quantizer:
    """DeepSeek-V3 / Qwen3-FP8 layout: e4m3 weight, float32 `weight_scale_inv` per block."""

    def quantize(
        name: str, weight: torch.Tensor, gen: torch.Generator
    ) -> tuple[Tensors, torch.Tensor]:
        rows, cols = weight.shape
        b0, b1 = block
        blocks = weight.view(rows // b0, b0, cols // b1, b1)
        scale = (blocks.abs().amax(dim=(1, 3)) / 448).clamp(min=1e-6)  # [R/b0, C/b1]
        expanded = scale.repeat_interleave(b0, 0).repeat_interleave(b1, 1)
        q = (weight / expanded).to(torch.float8_e4m3fn)
        return {"weight": q, "weight_scale_inv": scale}, q.float() * expanded

    return quantize


def _round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 code (sign in bit 3) of each value."""
    magnitude = (x.abs().unsqueeze(-1) - E2M1).abs().argmin(-1)
    return magnitude | ((x < 0).to(torch.int64) << 3)


def nvfp4_modelopt() -> Quantizer:
    """ModelOpt NVFP4: uint8 e2m1 pairs, e4m3 scales per 16, float32 `weight_scale_2`."""

    def quantize(
        name: str, weight: torch.Tensor, gen: torch.Generator
    ) -> tuple[Tensors, torch.Tensor]:
        rows, cols = weight.shape
        scale_2 = weight.abs().amax() / (448 * 6)
        grouped = weight.view(rows, cols // 16, 16)
        scales = (grouped.abs().amax(-1) / 6 / scale_2).to(torch.float8_e4m3fn)
        effective = (scales.float() * scale_2).clamp(min=1e-12).unsqueeze(-1)
        codes = _round_e2m1(grouped / effective).view(rows, cols)
        values = E2M1[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
        reference = values.view(rows, cols // 16, 16) * (scales.float() * scale_2).unsqueeze(-1)
        packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
        tensors = {"weight": packed, "weight_scale": scales, "weight_scale_2": scale_2.reshape(())}
        return tensors, reference.view(rows, cols)

    return quantize


def compressed(args: dict[str, object], fmt: str) -> Quantizer:
    """compressed-tensors: scales by its own `calculate_qparams`, packing by its compressor;
    the reference is its own `decompress` (float32)."""

    def quantize(
        name: str, weight: torch.Tensor, gen: torch.Generator
    ) -> tuple[Tensors, torch.Tensor]:
        from compressed_tensors.compressors.base import BaseCompressor
        from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
        from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

        qargs = QuantizationArgs(**args)
        scheme = QuantizationScheme(targets=["Linear"], weights=qargs)
        group = qargs.group_size or weight.shape[1]
        if qargs.strategy == "block":
            group = weight.shape[1]
        grouped = weight.view(weight.shape[0], -1, group)
        low, high = grouped.amin(-1).clamp(max=0), grouped.amax(-1).clamp(min=0)
        global_scale = (
            generate_gparam(weight.min(), weight.max()) if fmt.startswith("nvfp4") else None
        )
        if qargs.strategy == "tensor":
            low, high = weight.min().clamp(max=0).reshape(1), weight.max().clamp(min=0).reshape(1)
        scale, zero = calculate_qparams(low, high, qargs, global_scale=global_scale)
        state = {"weight": weight, "weight_scale": scale, "weight_zero_point": zero}
        if global_scale is not None:
            state["weight_global_scale"] = global_scale
        compressor = BaseCompressor.load_from_registry(fmt)
        tensors = dict(compressor.compress(state, scheme))
        reference = compressor.decompress(dict(tensors), scheme)["weight"].float()
        if fmt.startswith("nvfp4"):
            # compressed-tensors dequantizes NVFP4 in bfloat16; the float32 formula, on its own
            # unpacking: q * (scale / global_scale)
            from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8

            rows, cols = weight.shape
            q = unpack_fp4_from_uint8(tensors["weight_packed"], rows, cols, dtype=torch.float32)
            scale = tensors["weight_scale"].float() / tensors["weight_global_scale"].float()
            exact = (q.view(rows, -1, 16) * scale.unsqueeze(-1)).view(rows, cols)
            torch.testing.assert_close(exact.bfloat16().float(), reference, rtol=1e-2, atol=1e-3)
            reference = exact
        return tensors, reference

    return quantize


def write_quantized(
    model: torch.nn.Module,
    out: Path,
    quantizer: Quantizer,
    quantization_config: dict[str, object],
    seed: int = 0,
) -> Tensors:
    """Save `model` with every decoder linear quantized by `quantizer` (embeddings, norms and
    the LM head stay float32, as producers leave them) into `out`; return the reference state
    dict (float32, dequantized) for transformers."""
    gen = torch.Generator().manual_seed(seed)
    _PERMS.clear()
    state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    tensors: Tensors = {}
    reference: Tensors = {}
    for name, value in state.items():
        module, _, suffix = name.rpartition(".")
        if suffix == "weight" and module.split(".")[-1] in LINEARS:
            packed, dequantized = quantizer(module, value.float(), gen)
            tensors.update({f"{module}.{key}": t.contiguous() for key, t in packed.items()})
            reference[name] = dequantized
        else:
            tensors[name] = value.contiguous()
            reference[name] = value
    if getattr(model.config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(config, indent=2, default=str))
    return reference


def quantize_fp8_in_place(
    checkpoint: Path,
    block: tuple[int, int],
    wanted: Callable[[str], bool],
    reference: Path | None = None,
) -> int:
    """Quantize every 2-D tensor of `checkpoint` that `wanted` names and the blocks divide to
    FP8 with block scales, in place, as the FP8 releases store them (the rest stays float);
    with `reference`, also write a float checkpoint of the dequantized weights there. Returns
    how many tensors were quantized."""
    if reference is not None:
        shutil.copytree(checkpoint, reference)
    tensors = load_file(str(checkpoint / "model.safetensors"))
    quantize = fp8_block(block)
    packed: Tensors = {}
    dense: Tensors = {}
    count = 0
    for name, value in tensors.items():
        module = name.removesuffix(".weight")
        fits = value.dim() == 2 and not (value.shape[0] % block[0] or value.shape[1] % block[1])
        if wanted(name) and fits:
            parts, dequantized = quantize(module, value.float(), torch.Generator())
            packed.update({f"{module}.{key}": t.contiguous() for key, t in parts.items()})
            dense[name] = dequantized.contiguous()
            count += 1
        else:
            packed[name] = dense[name] = value
    save_file(packed, str(checkpoint / "model.safetensors"), metadata={"format": "pt"})
    if reference is not None:
        save_file(dense, str(reference / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((checkpoint / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8", "weight_block_size": list(block), "activation_scheme": "dynamic",
    }  # fmt: skip
    (checkpoint / "config.json").write_text(json.dumps(config))
    return count
