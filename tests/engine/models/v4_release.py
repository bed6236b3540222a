"""A tiny DeepSeek-V4 checkpoint written as the release stores its weights: attention and
shared-expert linears FP8 (e4m3) with E8M0 block scales named `scale`, routed experts FP4 (e2m1
codes two per int8 byte, even column in the low nibble, an E8M0 scale per 32 columns), and
beside it the same model with those weights dequantized, for transformers to run."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8 = re.compile(
    r"\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)\.weight$|\.shared_experts\.w[123]\.weight$"
)
FP4 = re.compile(r"\.experts\.\d+\.w[123]\.weight$")
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _power_of_two(amax: torch.Tensor, top: float) -> torch.Tensor:
    """The E8M0 scale (a power of two) that brings `amax` within `top`."""
    return torch.exp2(torch.ceil(torch.log2(torch.clamp(amax, min=1e-30) / top)))


def fp8_blocks(weight: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes float8_e4m3fn, scales float8_e8m0fnu [N/b, K/b], the dequantized weight)."""
    rows, cols = weight.shape
    tiles = weight.float().reshape(rows // block, block, cols // block, block)
    scale = _power_of_two(tiles.abs().amax(dim=(1, 3)), 448.0)  # [N/b, K/b]
    expanded = scale[:, None, :, None]
    codes = (tiles / expanded).to(torch.float8_e4m3fn)
    dequantized = (codes.float() * expanded).reshape(rows, cols)
    return codes.reshape(rows, cols), scale.to(torch.float8_e8m0fnu), dequantized


def fp4_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes int8 [N, K/2], scales float8_e8m0fnu [N, K/32], the dequantized weight)."""
    rows, cols = weight.shape
    groups = weight.float().reshape(rows, cols // 32, 32)
    scale = _power_of_two(groups.abs().amax(dim=-1), 6.0)  # [N, K/32]
    scaled = groups / scale[..., None]
    index = (scaled.abs()[..., None] - E2M1).abs().argmin(dim=-1)  # nearest magnitude
    negative = (scaled < 0) & (index > 0)
    codes = (index + 8 * negative).reshape(rows, cols).to(torch.uint8)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(torch.int8)
    values = E2M1[index] * torch.where(negative, -1.0, 1.0) * scale[..., None]
    return packed, scale.to(torch.float8_e8m0fnu), values.reshape(rows, cols)


def write_release(source: Path, quantized: Path, reference: Path, block: int = 16) -> None:
    """`quantized`: `source` (a float checkpoint under the release's names) as released;
    `reference`: the same with the dequantized values, unquantized."""
    for out in (quantized, reference):
        shutil.copytree(source, out)
    config = json.loads((source / "config.json").read_text())
    quant = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "scale_fmt": "ue8m0",
        "weight_block_size": [block, block],
    }
    (quantized / "config.json").write_text(
        json.dumps({**config, "quantization_config": quant, "expert_dtype": "fp4"})
    )
    for file in source.glob("*.safetensors"):
        packed, plain = {}, {}
        for name, tensor in load_file(str(file)).items():
            stem = name.removesuffix(".weight")
            if FP8.search(name):
                codes, scale, plain[name] = fp8_blocks(tensor, block)
                packed[name], packed[f"{stem}.scale"] = codes, scale
            elif FP4.search(name):
                codes, scale, plain[name] = fp4_rows(tensor)
                packed[name], packed[f"{stem}.scale"] = codes, scale
            else:
                packed[name] = plain[name] = tensor
        save_file(packed, str(quantized / file.name), metadata={"format": "pt"})
        save_file(plain, str(reference / file.name), metadata={"format": "pt"})
