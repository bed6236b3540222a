"""The Qwen vision encoder against transformers' on the same random weights: Qwen3-VL's (with
DeepStack features) and Qwen3.5's, two images of different grids in one call (attention must
stay within each image), and a two-frame grid; bad inputs are refused by name."""

from __future__ import annotations

import pytest
import torch

from dgpp.engine.vision.qwen_vision import QwenVisionEncoder, VisionConfig

TINY = {
    "depth": 3,
    "hidden_size": 32,
    "num_heads": 2,
    "intermediate_size": 64,
    "patch_size": 4,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "out_hidden_size": 48,
    "num_position_embeddings": 36,
}
GRIDS = [[1, 4, 6], [1, 8, 4], [2, 2, 2]]


def _reference(family: str) -> torch.nn.Module:
    if family == "qwen3_vl":
        from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

        config = Qwen3VLVisionConfig(**TINY, deepstack_visual_indexes=[0, 2])
        model_class = Qwen3VLVisionModel
    else:
        from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

        config = Qwen3_5VisionConfig(**TINY)
        model_class = Qwen3_5VisionModel
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():  # the initialiser leaves some tensors at zero or one; make all count
        for parameter in model.parameters():
            parameter.copy_(torch.randn_like(parameter) * 0.2)
    return model


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_image_tokens_equal_transformers(family: str) -> None:
    reference = _reference(family)
    config = VisionConfig.from_dict(reference.config.to_dict())
    ours = QwenVisionEncoder(config).eval()
    ours.load_state_dict(reference.state_dict())
    grid = torch.tensor(GRIDS)
    generator = torch.Generator().manual_seed(1)
    pixels = torch.randn(int(grid.prod(-1).sum()), config.patch_dim, generator=generator)
    with torch.no_grad():
        want = reference(pixels, grid_thw=grid)
        tokens, deepstack = ours(pixels, grid)
    assert tokens.shape == (pixels.shape[0] // 4, 48)
    torch.testing.assert_close(tokens, want.pooler_output, rtol=1e-4, atol=1e-4)
    expected = list(getattr(want, "deepstack_features", None) or [])
    assert len(deepstack) == len(expected) == (2 if family == "qwen3_vl" else 0)
    for got, ref in zip(deepstack, expected, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    # each image alone gives its own rows: attention never crosses images
    first = int(grid[0].prod())
    with torch.no_grad():
        alone, _ = ours(pixels[:first], grid[:1])
    torch.testing.assert_close(alone, tokens[: first // 4], rtol=1e-5, atol=1e-5)


def test_bad_inputs_are_refused_by_name() -> None:
    ours = QwenVisionEncoder(VisionConfig.from_dict(TINY))
    patch = ours.config.patch_dim
    with pytest.raises(ValueError, match="pixel_values must be"):
        ours(torch.zeros(16, patch + 1), torch.tensor([[1, 4, 4]]))
    with pytest.raises(ValueError, match="whole number of 2x2 blocks"):
        ours(torch.zeros(12, patch), torch.tensor([[1, 3, 4]]))
    with pytest.raises(ValueError, match="do not match"):
        ours(torch.zeros(15, patch), torch.tensor([[1, 4, 4]]))
    with pytest.raises(ValueError, match="hidden_act"):
        VisionConfig.from_dict({**TINY, "hidden_act": "relu6"})
    with pytest.raises(ValueError, match="square grid"):
        VisionConfig.from_dict({**TINY, "num_position_embeddings": 30})
