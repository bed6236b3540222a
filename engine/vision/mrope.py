"""Multimodal rotary positions (M-RoPE) of the Qwen vision-language families: each prompt token
has three positions (time, height, width). Text tokens have all three equal and count up; an
image's tokens take its grid of merged patches (time, row, column) offset by the position it
starts at, and the text after it continues from there plus the larger side of the grid, so a
prompt's positions run shorter than its tokens by a fixed `delta` from then on (decoded tokens
sit at `index + delta`, all three equal). As transformers' Qwen3-VL / Qwen3.5 `get_rope_index`
(images; each video frame is an image there too).

The rotary angles interleave the three: frequency j rotates by the height position where
j % 3 == 1 and j < 3 * section[1], by the width position where j % 3 == 2 and
j < 3 * section[2], by the time position elsewhere (`mrope_section`, `mrope_interleaved`).
"""

from __future__ import annotations

import torch

TEXT, IMAGE = 0, 1


def mrope_positions(
    token_types: list[int], grids: list[tuple[int, int, int]], merge: int
) -> tuple[torch.Tensor, int]:
    """`(positions [3, len(token_types)] int64, delta)` of a prompt whose tokens are text (0) or
    image (1) placeholders; `grids` are the images' (t, h, w) in patches, in prompt order, each
    standing for a run of t * h * w / merge^2 image tokens."""
    out: list[torch.Tensor] = []
    images = iter(grids)
    position, index, n = 0, 0, len(token_types)
    while index < n:
        end = index
        while end < n and token_types[end] == token_types[index]:
            end += 1
        if token_types[index] == TEXT:
            out.append(torch.arange(position, position + end - index).expand(3, -1))
            position += end - index
            index = end
            continue
        t, h, w = next(images, (0, 0, 0))
        count = t * (h // merge) * (w // merge)
        if count == 0 or count > end - index:
            raise ValueError("image placeholder tokens do not match the images' grids")
        grid = torch.meshgrid(
            torch.arange(t), torch.arange(h // merge), torch.arange(w // merge), indexing="ij"
        )
        out.append(torch.stack(grid).reshape(3, -1) + position)
        position += max(h, w) // merge
        index += count  # back-to-back images: the next one starts here
    if next(images, None) is not None:
        raise ValueError("more images than image placeholders in the prompt")
    positions = torch.cat(out, dim=1) if out else torch.zeros(3, 0, dtype=torch.long)
    delta = int(positions.max()) + 1 - n if n else 0
    return positions, delta


def mrope_angles(
    positions: torch.Tensor, inv_freq: torch.Tensor, section: tuple[int, int, int]
) -> torch.Tensor:
    """Rotary angles [N, dim / 2] of positions [3, N] (time, height, width), interleaved."""
    freqs = positions[..., None].float() * inv_freq.float()  # [3, N, dim / 2]
    angles = freqs[0].clone()
    for axis in (1, 2):
        picked = slice(axis, section[axis] * 3, 3)
        angles[:, picked] = freqs[axis][:, picked]
    return angles
