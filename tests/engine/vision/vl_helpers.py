"""Prompts with images for the tiny vision-language checkpoints, and transformers' greedy
tokens for them."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from dgpp.engine.scheduling.request import PromptIds
from dgpp.engine.vision.spans import ImageSpan, PromptImage, image_digest

PATCH_DIM = 3 * 2 * 4 * 4  # channels x temporal x 4 x 4 patches (tests/conftest.py)
# The tiny configs' special tokens (tests/conftest.py IMAGE_TOKENS)
IMAGE, START, END = 49100, 49102, 49103

Part = list[int] | tuple[tuple[int, int, int], int]  # text ids, or (grid in patches, seed)


# Qwen3-VL as the issue built it: interleaved M-RoPE in sections of 4/6/6 frequencies.
QWEN3_VL = {
    "head_dim": 32,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [4, 6, 6],
        "mrope_interleaved": True,
    },
}


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


def hf_vl_logits(
    model: torch.nn.Module, prompt: PromptIds, continuation: list[int]
) -> torch.Tensor:
    """transformers' float32 logits [S, V] over `prompt + continuation` in one forward (its
    M-RoPE positions from `get_rope_index` over the whole sequence)."""
    sequence = [*prompt, *continuation]
    extra = {}
    if prompt.images:
        extra = {
            "pixel_values": torch.cat([image.pixel_values for image in prompt.images]),
            "image_grid_thw": torch.tensor([image.span.patch_grid(2) for image in prompt.images]),
        }
    types = torch.tensor([[int(token == IMAGE) for token in sequence]])
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([sequence]), mm_token_type_ids=types, **extra).logits
    return logits[0].float()


# A Qwen-VL-style chat template for the tiny checkpoints (ChatML; an image part becomes its
# placeholder between vision markers, as the Qwen3-VL and Qwen3.5 templates write it).
VL_TEMPLATE = (
    "{%- for message in messages -%}<|im_start|>{{ message.role }}\n"
    "{%- if message.content is string %}{{ message.content }}{% else %}"
    "{% for part in message.content %}{% if part.type == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif part.type == 'text' %}{{ part.text }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor -%}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif -%}"
)
VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
# The tiny image processor: 4-pixel patches merged 2x2, so a vision token is 8x8 pixels; images
# are resized to 256 .. 4096 pixels (4 .. 64 tokens).
PROCESSOR = {
    "patch_size": 4,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "size": {"shortest_edge": 256, "longest_edge": 4096},
}


def build_vl_checkpoint(out: Path, tokenizer_dir: Path, architecture: str) -> Path:
    """A tiny checkpoint a server can take images for: the SmolLM2 tokenizer with the vision
    markers added (ids past its vocabulary, which the model's covers), the template above and
    the image processor's settings."""
    from transformers import AutoTokenizer

    from tests.conftest import tiny_model

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tokenizer.chat_template = VL_TEMPLATE
    start, image, end = tokenizer.convert_tokens_to_ids(VISION_TOKENS)
    model = tiny_model(architecture, vocab_size=len(tokenizer) + 5)
    model.config.update(
        {"image_token_id": image, "vision_start_token_id": start, "vision_end_token_id": end}
    )
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    (out / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    return out
