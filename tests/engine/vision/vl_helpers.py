"""Prompts with images for the tiny vision-language checkpoints, and transformers' greedy
tokens for them."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dgpp.engine.request import PromptIds
from dgpp.engine.vision.spans import ImageSpan, PromptImage, image_digest

PATCH_DIM = 3 * 2 * 4 * 4  # channels x temporal x 4 x 4 patches (tests/conftest.py)
# The tiny configs' special tokens (tests/conftest.py IMAGE_TOKENS)
IMAGE, START, END = 49100, 49102, 49103

Part = list[int] | tuple[tuple[int, int, int], int]  # text ids, or (grid in patches, seed)


def pixels(grid: tuple[int, int, int], seed: int) -> torch.Tensor:
    """A random image's processor rows for `grid` (t, h, w in patches)."""
    t, h, w = grid
    return torch.randn(t * h * w, PATCH_DIM, generator=torch.Generator().manual_seed(seed))


def vl_prompt(parts: Sequence[Part]) -> PromptIds:
    """Text and images in order; each image as the chat template writes it: vision start,
    its placeholder run, vision end."""
    ids: list[int] = []
    images = []
    for part in parts:
        if isinstance(part, list):
            ids += part
            continue
        grid, seed = part
        values = pixels(grid, seed)
        ids.append(START)
        span = ImageSpan(len(ids), grid[0], grid[1] // 2, grid[2] // 2, image_digest(values, grid))
        images.append(PromptImage(span, values))
        ids += [IMAGE] * span.tokens
        ids.append(END)
    return PromptIds(ids, images=images)


def hf_vl_greedy(model: torch.nn.Module, prompt: PromptIds, max_new_tokens: int) -> list[int]:
    """transformers' greedy tokens for a prompt with images (the whole sequence every step)."""
    grids = [image.span.patch_grid(2) for image in prompt.images]
    extra = {}
    if prompt.images:
        extra = {
            "pixel_values": torch.cat([image.pixel_values for image in prompt.images]),
            "image_grid_thw": torch.tensor(grids),
        }
    sequence = list(prompt)
    tokens = []
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            types = torch.tensor([[int(token == IMAGE) for token in sequence]])
            logits = model(
                input_ids=torch.tensor([sequence]), mm_token_type_ids=types, **extra
            ).logits
            tokens.append(int(logits[0, -1].argmax()))
            sequence.append(tokens[-1])
    return tokens
