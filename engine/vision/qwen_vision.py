"""The vision encoder of the Qwen vision-language families (Qwen3-VL, Qwen3-VL-MoE, Qwen3.5 and
Qwen3.5-MoE `…ForConditionalGeneration`): image patches in, one embedding per 2x2 merged patch
out (the tokens that stand in for an image's placeholder tokens in the prompt), and for Qwen3-VL
the DeepStack features its text model adds to the hidden states of its first layers.

The computation is transformers' (`Qwen3VLVisionModel`, `Qwen3_5VisionModel`) on the same
weights, under the same parameter names (the checkpoint's `model.visual.*` loads as it is):

- patch embedding: a Conv3d whose kernel equals its stride, so one linear map of each flattened
  `[channels, temporal, patch, patch]` patch;
- the learned square grid of position embeddings resampled bilinearly (align_corners) to each
  image's patch grid, patches in 2x2 merge-block order (the order the processor emits);
- 2-D axial rotary positions (row, column) over the whole head, attention within each frame of
  each image only (non-causal), pre-LayerNorm blocks with a GELU MLP;
- the patch merger: LayerNorm, the 2x2 neighbours concatenated, a GELU MLP to the text model's
  width; DeepStack mergers (LayerNorm after the concatenation) at `deepstack_visual_indexes`.

Images arrive as the HF image processor's `pixel_values` rows and `image_grid_thw` (temporal,
height, width in patches), so the pixels (resize, normalisation) are the reference's own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dgpp.engine.layers.rotary import RopeAngles, apply_rotary

_ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "silu": F.silu,
}


@dataclass(frozen=True)
class VisionConfig:
    """The fields of a checkpoint's `vision_config` the encoder reads."""

    hidden_size: int
    num_heads: int
    intermediate_size: int
    depth: int
    out_hidden_size: int
    num_position_embeddings: int
    patch_size: int = 16
    temporal_patch_size: int = 2
    in_channels: int = 3
    spatial_merge_size: int = 2
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0
    deepstack_visual_indexes: tuple[int, ...] = field(default_factory=tuple)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> VisionConfig:
        rope = raw.get("rope_parameters") or {}
        names = set(cls.__dataclass_fields__) - {"rope_theta", "deepstack_visual_indexes"}
        values = {name: raw[name] for name in names if name in raw}
        return cls(
            **values,
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
            deepstack_visual_indexes=tuple(raw.get("deepstack_visual_indexes") or ()),
        )

    def __post_init__(self) -> None:
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"vision hidden_act {self.hidden_act!r} is not supported")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ValueError("vision head size must be a multiple of 4 (2-D rotary)")
        if round(self.num_position_embeddings**0.5) ** 2 != self.num_position_embeddings:
            raise ValueError("num_position_embeddings must be a square grid")

    @property
    def patch_dim(self) -> int:
        """Values in one `pixel_values` row."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


class PatchEmbed(nn.Module):
    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        kernel = (c.temporal_patch_size, c.patch_size, c.patch_size)
        self.proj = nn.Conv3d(c.in_channels, c.hidden_size, kernel, stride=kernel, bias=True)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight.reshape(self.proj.weight.shape[0], -1)
        return F.linear(pixels.to(weight.dtype), weight, self.proj.bias)


class VisionAttention(nn.Module):
    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.num_heads = c.num_heads
        self.qkv = nn.Linear(c.hidden_size, 3 * c.hidden_size, bias=True)
        self.proj = nn.Linear(c.hidden_size, c.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, angles: RopeAngles, lengths: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, -1).unbind(1)
        # rotated in float32, as the reference does whatever the activations' dtype
        q, k = (apply_rotary(t.float(), angles).to(t.dtype) for t in (q, k))
        outs = []
        for qs, ks, vs in zip(*(t.split(lengths) for t in (q, k, v)), strict=True):
            # [1, heads, n, d]: the 4-D form takes the fused (flash) kernel on CPU too; the
            # 3-D one fell back to materialised scores (2.4x slower at 4K patches, measured)
            out = F.scaled_dot_product_attention(
                *(t.transpose(0, 1).unsqueeze(0) for t in (qs, ks, vs))
            )
            outs.append(out[0].transpose(0, 1))
        return self.proj(torch.cat(outs).reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(c.hidden_size, c.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(c.intermediate_size, c.hidden_size, bias=True)
        self.act = _ACTIVATIONS[c.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(c.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(c.hidden_size, eps=1e-6)
        self.attn = VisionAttention(c)
        self.mlp = VisionMLP(c)

    def forward(self, x: torch.Tensor, angles: RopeAngles, lengths: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), angles, lengths)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """2x2 neighbouring patches to one token of the text model's width; `after` normalises the
    concatenation (DeepStack's mergers), else each patch before it (the final merger)."""

    def __init__(self, c: VisionConfig, after: bool) -> None:
        super().__init__()
        self.width = c.hidden_size * c.spatial_merge_size**2
        self.after = after
        self.norm = nn.LayerNorm(self.width if after else c.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, c.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.reshape(-1, self.width)) if self.after else self.norm(x)
        return self.linear_fc2(F.gelu(self.linear_fc1(x.reshape(-1, self.width))))


class QwenVisionEncoder(nn.Module):
    """`forward(pixel_values, grid_thw)` -> (image tokens [sum(t*h*w) / merge^2, out_hidden],
    DeepStack features: one tensor of the same shape per `deepstack_visual_indexes` entry)."""

    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.config = c
        self.side = round(c.num_position_embeddings**0.5)
        self.patch_embed = PatchEmbed(c)
        self.pos_embed = nn.Embedding(c.num_position_embeddings, c.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(c) for _ in range(c.depth))
        self.merger = PatchMerger(c, after=False)
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(c, after=True) for _ in c.deepstack_visual_indexes
        )
        head = c.hidden_size // c.num_heads
        steps = torch.arange(0, head // 2, 2, dtype=torch.float32) / (head // 2)
        self.register_buffer("inv_freq", 1.0 / c.rope_theta**steps, persistent=False)

    def forward(
        self, pixel_values: torch.Tensor, grid_thw: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        grids = [tuple(int(v) for v in row) for row in grid_thw.tolist()]
        _check(self.config, pixel_values, grids)
        x = self.patch_embed(pixel_values)
        x = x + self._positions(grids).to(x.dtype)
        angles = self._rotary(grids)
        lengths = [h * w for t, h, w in grids for _ in range(t)]  # attention within each frame
        deepstack = []
        for index, block in enumerate(self.blocks):
            x = block(x, angles, lengths)
            if index in self.config.deepstack_visual_indexes:
                at = self.config.deepstack_visual_indexes.index(index)
                deepstack.append(self.deepstack_merger_list[at](x))
        return self.merger(x), deepstack

    def _positions(self, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """The learned grid resampled to each image's (h, w), in merge-block order."""
        m, dim = self.config.spatial_merge_size, self.config.hidden_size
        table = self.pos_embed.weight.float().reshape(self.side, self.side, dim)
        table = table.permute(2, 0, 1)[None]
        out = []
        for t, h, w in grids:
            grid = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)[0]
            grid = grid.permute(1, 2, 0).reshape(h // m, m, w // m, m, dim).transpose(1, 2)
            out.append(grid.reshape(h * w, dim).repeat(t, 1))
        return torch.cat(out)

    def _rotary(self, grids: list[tuple[int, int, int]]) -> RopeAngles:
        """(cos, signed sin) [N, 1, head] of each patch's (row, column), as the layers rotate."""
        m = self.config.spatial_merge_size
        rows, cols = [], []
        for t, h, w in grids:
            r, c = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
            shape = (h // m, m, w // m, m)
            rows.append(r.reshape(shape).transpose(1, 2).flatten().repeat(t))
            cols.append(c.reshape(shape).transpose(1, 2).flatten().repeat(t))
        angles = [torch.cat(p)[:, None].float() * self.inv_freq for p in (rows, cols)]
        half = torch.cat(angles, dim=-1)
        cos, sin = half.cos(), half.sin()
        return torch.cat((cos, cos), -1)[:, None], torch.cat((-sin, sin), -1)[:, None]


def _check(c: VisionConfig, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> None:
    m = c.spatial_merge_size
    if pixels.dim() != 2 or pixels.shape[1] != c.patch_dim:
        raise ValueError(f"pixel_values must be [patches, {c.patch_dim}], got {list(pixels.shape)}")
    for t, h, w in grids:
        if t < 1 or h < m or w < m or h % m or w % m:
            raise ValueError(f"image grid {(t, h, w)} is not a whole number of {m}x{m} blocks")
    if sum(t * h * w for t, h, w in grids) != pixels.shape[0]:
        raise ValueError("pixel_values rows do not match the image grids")
