"""M-RoPE positions and angles against transformers' Qwen3-VL (`get_rope_index` and its text
rotary embedding) for prompts that mix text and images of different grids: the engine's own
`chunk_positions` / `shift_at` over a whole prompt, and its rotary tables' [3, T] lookup."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dgpp.engine.checkpoint.config import RopeConfig
from dgpp.engine.layers.rotary import RotaryEmbedding
from dgpp.engine.vision.spans import ImageSpan, chunk_positions, shift_at

MERGE = 2
TEXT, IMAGE = 0, 1


def _prompt(parts: list[object]) -> tuple[list[int], list[tuple[int, int, int]]]:
    """Token types for parts that are text lengths (int) or image grids (tuple)."""
    types: list[int] = []
    grids = []
    for part in parts:
        if isinstance(part, int):
            types += [TEXT] * part
        else:
            grids.append(part)
            t, h, w = part
            types += [IMAGE] * (t * (h // MERGE) * (w // MERGE))
    return types, grids


def _positions(types: list[int], grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, int]:
    """The engine's positions of the whole prompt and its shift after the last image."""
    spans, at = [], 0
    for t, h, w in grids:
        at = types.index(IMAGE, at)
        spans.append(ImageSpan(at, t, h // MERGE, w // MERGE, 0))
        at = spans[-1].end
    return chunk_positions(spans, 0, 0, len(types)), shift_at(spans, len(types))


def _reference(types: list[int], grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, int]:
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

    owner = SimpleNamespace(
        config=SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=MERGE)),
        get_vision_position_ids=lambda *a, **k: Qwen3VLModel.get_vision_position_ids(None, *a, **k),
    )
    ids = torch.zeros(1, len(types), dtype=torch.long)
    positions, deltas = Qwen3VLModel.get_rope_index(
        owner, ids, torch.tensor([types]), image_grid_thw=torch.tensor(grids) if grids else None
    )
    return positions[:, 0], int(deltas[0, 0])


PROMPTS = [
    [7],
    [3, (1, 4, 6), 5],
    [2, (1, 8, 4), 4, (1, 4, 4), 1],
    [(1, 6, 2), 3],
    [4, (1, 2, 2)],
]


@pytest.mark.parametrize("parts", PROMPTS, ids=str)
def test_positions_equal_transformers(parts: list[object]) -> None:
    types, grids = _prompt(parts)
    positions, delta = _positions(types, grids)
    want, want_delta = _reference(types, grids)
    assert torch.equal(positions, want)
    assert delta == want_delta


def test_angles_equal_transformers_rotary() -> None:
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    section = (8, 4, 4)
    config = Qwen3VLTextConfig(
        hidden_size=128,
        num_attention_heads=4,
        head_dim=32,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "mrope_section": section},
    )
    reference = Qwen3VLTextRotaryEmbedding(config)
    positions, _ = _positions(*_prompt([3, (1, 8, 4), 4]))
    cos, sin = reference(torch.zeros(1, dtype=torch.float32), positions[:, None])
    rope = RopeConfig(theta=5000.0, mrope_section=section)
    ours_cos, signed_sin = RotaryEmbedding(32, 64, rope).lookup(positions, torch.float32)
    torch.testing.assert_close(ours_cos[:, 0], cos[0])
    half = signed_sin.shape[-1] // 2  # the rotate-half sign lives in the first half
    torch.testing.assert_close(signed_sin[:, 0, half:], sin[0][:, half:])
    torch.testing.assert_close(-signed_sin[:, 0, :half], sin[0][:, :half])
