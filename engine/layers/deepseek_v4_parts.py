"""Pieces of DeepSeek-V4's attention that are not its caches: the rotary it applies to the
trailing dims of each head in interleaved pairs (and, since keys are values, undoes on the
output), and the grouped low-rank output projection.

- `rotate_trailing_pairs`: the last `rope` dims of each 512-dim head hold pairs (x0, x1),
  (x2, x3), ... each turned by its frequency, the layout kept (transformers'
  `apply_rotary_pos_emb` for V4), in float32. `inverse` turns by minus the angle: the value
  half of the shared key/value picked up the key's rotation, and the attention output's rope
  dims are turned back at the query's position before the output projection.
- `GroupedOutputProjection`: the heads' outputs [T, H * D] in `o_groups` groups, each group
  projected by its own block of `o_a_proj` to `o_lora_rank` dims, then all groups mixed by
  `o_b_proj`. Tensor parallel: whole groups per rank (the heads are split the same way), so
  `o_a_proj` is split by its rows and `o_b_proj` by its input: one all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from dgpp.engine.configuration.parallel import ParallelContext
from dgpp.engine.errors import ConfigError
from dgpp.engine.layers.linear import RowParallelLinear, WeightFormat
from dgpp.engine.layers.rotary import RopeAngles

FormatOf = Callable[[int, int, int], WeightFormat]  # (cols, in_start, in_total) -> format


def rotate_trailing_pairs(
    x: torch.Tensor, angles: RopeAngles, inverse: bool = False
) -> torch.Tensor:
    """x [T, heads, D] with its last dims (as many as `angles` cover, (cos, signed sin) in the
    rotate-half layout of `RotaryEmbedding.lookup`) rotated in interleaved pairs."""
    rope = angles[0].shape[-1]
    half = rope // 2
    cos = angles[0][..., :half].float().repeat_interleave(2, dim=-1)
    sin = angles[1][..., half:].float().repeat_interleave(2, dim=-1)
    part = x[..., -rope:].float()
    turned = torch.stack((-part[..., 1::2], part[..., 0::2]), dim=-1).flatten(-2)
    rotated = part * cos + turned * (-sin if inverse else sin)
    return torch.cat((x[..., :-rope], rotated.to(x.dtype)), dim=-1)


class DenseRows(nn.Module):
    """Rows `start ..` of a checkpoint's weight [rows, cols], kept dense and never packed: the
    grouped projection reads it as one block per group in a batched product."""

    def __init__(self, rows: int, cols: int, start: int) -> None:
        super().__init__()
        self.start = start
        self.weight = nn.Parameter(torch.empty(rows, cols), requires_grad=False)
        self.weight.weight_loader = self.load_rows  # type: ignore[attr-defined]

    def load_rows(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.copy_(loaded.narrow(0, self.start, param.shape[0]))


class GroupedOutputProjection(nn.Module):
    """`o_a_proj` (this rank's groups, [groups * rank, H * D / groups]) then `o_b_proj`."""

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        groups: int,
        rank: int,
        hidden_size: int,
        parallel: ParallelContext,
        formats: FormatOf | None = None,
    ) -> None:
        """`formats(cols, in_start, in_total)`: how `o_b_proj` keeps its weight (None: dense)."""
        super().__init__()
        if groups % parallel.tp_size or num_heads % groups:
            raise ConfigError(
                f"{groups} output groups of {num_heads} heads cannot be split over "
                f"{parallel.tp_size} ranks (whole groups per rank)"
            )
        self.groups = groups // parallel.tp_size
        self.group_width = num_heads * head_dim // groups
        local = self.groups * rank
        start = parallel.tp_rank * local
        self.o_a_proj = DenseRows(local, self.group_width, start)
        self.o_b_proj = RowParallelLinear(
            groups * rank,
            hidden_size,
            False,
            parallel,
            input_range=(start, local),
            weight_format=formats(local, start, groups * rank) if formats else None,
        )

    def forward(self, out: torch.Tensor) -> torch.Tensor:
        """This rank's heads' outputs [T, local heads * D] -> [T, hidden] (all-reduced)."""
        tokens = out.shape[0]
        grouped = out.view(tokens, self.groups, self.group_width).transpose(0, 1)  # [g, T, w]
        weight = self.o_a_proj.weight.view(self.groups, -1, self.group_width)  # [g, r, w]
        low_rank = torch.bmm(grouped, weight.transpose(1, 2)).transpose(0, 1)  # [T, g, r]
        return self.o_b_proj(low_rank.reshape(tokens, -1))
