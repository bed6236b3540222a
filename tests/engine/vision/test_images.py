"""Images from request bytes to encoder input: every accepted format decodes (an animation's
first frame), every refusal names its reason, the pixels are transformers' processor's own, and
the quality bounds set the token count (a request's override held inside the server's)."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from PIL import Image

from dgpp.engine.vision.images import (
    ImageInputError,
    ImageLimits,
    ImagePreparer,
    ImageQuality,
    decode_image,
    image_bytes,
)

PROCESSOR = {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2}
PROCESSOR |= {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
LIMITS = ImageLimits()


def _encoded(fmt: str, size: tuple[int, int] = (64, 48), frames: int = 1) -> bytes:
    rng = np.random.default_rng(0)
    images = [
        Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))
        for _ in range(frames)
    ]
    out = io.BytesIO()
    extra = {"save_all": True, "append_images": images[1:]} if frames > 1 else {}
    images[0].save(out, format=fmt, **extra)
    return out.getvalue()


def _data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_each_format_decodes_to_rgb(fmt: str) -> None:
    image = decode_image(image_bytes(_data_url(_encoded(fmt)), LIMITS), LIMITS)
    assert image.mode == "RGB" and image.size == (64, 48)


def test_an_animation_gives_its_first_frame() -> None:
    data = _encoded("GIF", frames=3)
    first = Image.open(io.BytesIO(data)).convert("RGB")
    assert np.array_equal(np.asarray(decode_image(data, LIMITS)), np.asarray(first))


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("data:image/png;base64,###", "not valid base64"),
        ("data:image/png,rawbytes", "must be base64"),
        ("https://example.com/cat.png", "not fetched by this server"),
        ("file:///etc/passwd", "must be a data URL"),
        (_data_url(b"not an image at all"), "could not be decoded"),
        (_data_url(_encoded("BMP"), "image/bmp"), "could not be decoded"),
        (_data_url(_encoded("PNG")[:60]), "could not be decoded"),
    ],
)
def test_bad_images_are_refused_with_the_reason(url: str, reason: str) -> None:
    with pytest.raises(ImageInputError, match=reason):
        decode_image(image_bytes(url, LIMITS), LIMITS)


def test_size_limits() -> None:
    data = _encoded("PNG", size=(300, 200))
    with pytest.raises(ImageInputError, match="larger than 100 bytes"):
        decode_image(data, ImageLimits(max_bytes=100))
    with pytest.raises(ImageInputError, match="larger than 100 bytes"):
        image_bytes(_data_url(data), ImageLimits(max_bytes=100))
    with pytest.raises(ImageInputError, match="300x200 pixels, more than 50000"):
        decode_image(data, ImageLimits(max_source_pixels=50_000))


def test_pixels_are_the_reference_processors() -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    image = decode_image(_encoded("PNG", size=(640, 480)), LIMITS)
    quality = ImageQuality(64 * 32 * 32, 300 * 32 * 32)
    prepared = ImagePreparer(PROCESSOR, quality).prepare(image)
    size = {"shortest_edge": quality.min_pixels, "longest_edge": quality.max_pixels}
    want = Qwen2VLImageProcessorPil(**PROCESSOR)(images=[image], size=size, return_tensors="pt")
    assert torch.equal(prepared.pixel_values, want["pixel_values"])
    assert list(prepared.grid_thw) == want["image_grid_thw"][0].tolist()
    t, h, w = prepared.grid_thw
    assert prepared.tokens == t * h * w // 4 == prepared.pixel_values.shape[0] // 4
    assert prepared.original_size == (640, 480)
    assert prepared.resized_size == (w * 16, h * 16)


def test_the_quality_bounds_set_the_token_count() -> None:
    image = decode_image(_encoded("PNG", size=(1280, 960)), LIMITS)
    server = ImagePreparer(PROCESSOR, ImageQuality(16 * 1024, 2 * 1024 * 1024))
    full = server.prepare(image)
    assert full.resized_size == (1280, 960) and full.tokens == 1200  # within bounds: as sent
    low = server.prepare(image, ImageQuality(16 * 1024, 256 * 1024))
    assert low.tokens <= 256 < full.tokens  # 1024 pixels a token
    assert abs(low.resized_size[0] / low.resized_size[1] - 4 / 3) < 0.1  # aspect kept
    # a request cannot go past the server's bounds
    capped = server.prepare(image, ImageQuality(16 * 1024, 64 * 1024 * 1024))
    assert capped.tokens == full.tokens
    small = decode_image(_encoded("PNG", size=(40, 30)), LIMITS)
    assert server.prepare(small).tokens >= 16  # scaled up to min_pixels
    with pytest.raises(ImageInputError, match="min_pixels <= max_pixels"):
        ImageQuality(10, 5)


def test_an_extreme_aspect_ratio_is_refused() -> None:
    image = decode_image(_encoded("PNG", size=(4000, 16)), LIMITS)
    with pytest.raises(ImageInputError, match="cannot be resized"):
        ImagePreparer(PROCESSOR, ImageQuality(1024, 1024 * 1024)).prepare(image)
