"""DeepSeek-V4's routed experts as released (`expert_dtype: fp4`), kept packed: per expert
`w1` (gate), `w3` (up) and `w2` (down), each an int8 weight [out, in / 2] of e2m1 codes (two per
byte, the even column in the low nibble) and an E8M0 scale [out, in / 32] per 32 input columns,
the MXFP4 form gpt-oss's experts use (`layers.mxfp4_experts`), so the same kernel runs them.

Loaded per expert into the stacked blocks: this rank's gate and up rows, its column blocks of
down (the intermediate width each rank holds must be a multiple of 32).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from dgpp.engine.layers.mxfp4_experts import BLOCK, BLOCK_BYTES, Mxfp4Experts, e8m0_bits

_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|scale)$")


def fp4_expert_target(name: str) -> tuple[str, tuple[int, int]] | None:
    """A per-expert FP4 tensor's stacked parameter and (expert, part: gate 0, up 1, down 0)."""
    found = _EXPERT.match(name)
    if found is None:
        return None
    stem, expert, projection, kind = found.groups()
    fused = "down_proj" if projection == "down_proj" else "gate_up_proj"
    suffix = "blocks" if kind == "weight" else "scales"
    return f"{stem}.{fused}_{suffix}", (int(expert), int(projection == "up_proj"))


def exponents(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 scales as their biased exponents (uint8), whether stored as float8_e8m0fnu or
    as bytes."""
    if scale.dtype == torch.float8_e8m0fnu:
        return scale.view(torch.uint8)
    return scale.to(torch.uint8)


class Fp4Experts(Mxfp4Experts):
    """`Mxfp4Experts` whose tensors come one expert and projection at a time."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        for name in ("gate_up_proj_blocks", "gate_up_proj_scales"):
            getattr(self, name).weight_loader = self.load_gate_up_expert  # type: ignore[attr-defined]
        for name in ("down_proj_blocks", "down_proj_scales"):
            getattr(self, name).weight_loader = self.load_down_expert  # type: ignore[attr-defined]

    @staticmethod
    def _blocks(param: nn.Parameter, loaded: torch.Tensor) -> torch.Tensor:
        """A weight [out, in / 2] as [out, in / 32, 16] bytes, or a scale as bfloat16 bits."""
        if param.dtype == torch.int16:
            return e8m0_bits(exponents(loaded))
        codes = loaded.contiguous().view(torch.uint8)
        return codes.view(codes.shape[0], -1, BLOCK_BYTES)

    def load_gate_up_expert(
        self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple[int, int]
    ) -> None:
        expert, part = shard
        rows = self._own(self._blocks(param, loaded), 0)
        param.data[expert, part * self.local : (part + 1) * self.local].copy_(rows)

    def load_down_expert(
        self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple[int, int]
    ) -> None:
        start, count = self.start // BLOCK, self.local // BLOCK
        param.data[shard[0]].copy_(self._blocks(param, loaded).narrow(1, start, count))
