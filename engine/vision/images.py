"""Images in requests, up to the encoder's input: the bytes of an image part (a data URL or
base64), decoded and checked, then resized and normalised by the checkpoint's own image processor
(transformers' PIL-backed Qwen-VL processor, so the pixels are the reference's), within the
image-quality bounds that decide how many vision tokens an image costs.

Every refusal is an `ImageInputError` whose message names what was wrong; the API layers turn it
into a 400 that names the part.
"""

from __future__ import annotations

import base64
import binascii
import io
import warnings
from dataclasses import dataclass
from typing import Any

import torch

# What the server decodes: the formats the OpenAI and Anthropic APIs accept.
FORMATS = ("PNG", "JPEG", "WEBP", "GIF")


class ImageInputError(ValueError):
    """An image part the server cannot take, with the reason."""


@dataclass(frozen=True)
class ImageLimits:
    """What one image may be before it is decoded and after."""

    max_bytes: int = 20 * 2**20  # the encoded image (OpenAI's and Anthropic's limits are ~20 MB)
    max_source_pixels: int = 50_000_000  # decoded width x height: refuses decompression bombs
    fetch_urls: bool = False  # http(s) URLs are fetched (else refused)
    fetch_timeout_s: float = 10.0  # for the whole fetch


@dataclass(frozen=True)
class ImageQuality:
    """Bounds on an image's resized pixel count (the image-quality knob): the image is scaled,
    keeping its aspect ratio, so its pixels lie between them; each 32x32 square of the resized
    image (a 2x2 block of 16-pixel patches) is one vision token."""

    min_pixels: int
    max_pixels: int

    def __post_init__(self) -> None:
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ImageInputError(
                f"image quality needs 0 < min_pixels <= max_pixels, got {self.min_pixels} "
                f"and {self.max_pixels}"
            )

    def within(self, other: ImageQuality | None) -> ImageQuality:
        """A request's override, held inside these (the server's) bounds."""
        if other is None:
            return self
        low = min(max(other.min_pixels, self.min_pixels), self.max_pixels)
        high = max(min(other.max_pixels, self.max_pixels), low)
        return ImageQuality(low, high)


@dataclass(frozen=True)
class PreparedImage:
    """One image as the encoder takes it, and what it cost."""

    pixel_values: torch.Tensor  # [t * h * w, channels * temporal * patch * patch]
    grid_thw: tuple[int, int, int]  # in patches
    original_size: tuple[int, int]  # (width, height) as the client sent it
    resized_size: tuple[int, int]  # (width, height) the model saw
    tokens: int  # vision tokens in the prompt


def image_bytes(url: str, limits: ImageLimits) -> bytes:
    """The bytes of an `image_url`'s URL: a base64 data URL, or an http(s) URL where the
    limits allow fetching."""
    if url.startswith("data:"):
        header, _, payload = url.partition(",")
        if not header.endswith(";base64"):
            raise ImageInputError("an image data URL must be base64 (data:image/...;base64,...)")
        return base64_bytes(payload, limits)
    if url.startswith(("http://", "https://")):
        if not limits.fetch_urls:
            raise ImageInputError(
                "image URLs over http(s) are not fetched by this server (http.image_url_fetch "
                "is off); send the image as a base64 data URL"
            )
        return fetch_bytes(url, limits)
    raise ImageInputError("an image URL must be a data URL (data:image/...;base64,...)")


def fetch_bytes(url: str, limits: ImageLimits) -> bytes:
    """GET `url`: at most `max_bytes`, within `fetch_timeout_s` altogether."""
    import time
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + limits.fetch_timeout_s
    request = urllib.request.Request(url, headers={"User-Agent": "dgpp"})
    chunks, size = [], 0
    try:
        with urllib.request.urlopen(request, timeout=limits.fetch_timeout_s) as response:
            while chunk := response.read(1 << 16):
                size += len(chunk)
                if size > limits.max_bytes:
                    raise ImageInputError(f"the image is larger than {limits.max_bytes} bytes")
                if time.monotonic() > deadline:
                    raise TimeoutError("the fetch took too long")
                chunks.append(chunk)
    except ImageInputError:
        raise
    except (OSError, ValueError, urllib.error.URLError) as err:  # refused, 404, timeout
        raise ImageInputError(f"the image URL could not be fetched ({err})") from None
    return b"".join(chunks)


def base64_bytes(payload: str, limits: ImageLimits) -> bytes:
    if len(payload) > limits.max_bytes * 4 // 3 + 4:
        raise ImageInputError(f"the image is larger than {limits.max_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as err:
        raise ImageInputError(f"the image is not valid base64 ({err})") from None


def decode_image(data: bytes, limits: ImageLimits) -> Any:
    """A PIL image in RGB (the first frame of an animation) from encoded bytes."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > limits.max_bytes:
        raise ImageInputError(f"the image is larger than {limits.max_bytes} bytes")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=FORMATS)
    except UnidentifiedImageError:
        raise ImageInputError(
            f"the image could not be decoded (supported: {', '.join(FORMATS)})"
        ) from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        raise ImageInputError(f"the image could not be decoded ({err})") from None
    width, height = image.size  # from the header: nothing decoded yet
    if width * height > limits.max_source_pixels:
        raise ImageInputError(
            f"the image has {width}x{height} pixels, more than {limits.max_source_pixels} "
            "(max_source_pixels)"
        )
    try:
        image.seek(0)
        return image.convert("RGB")
    except (OSError, SyntaxError, ValueError) as err:  # a truncated or corrupt payload
        raise ImageInputError(f"the image could not be decoded ({err})") from None


class ImagePreparer:
    """A checkpoint's image processor (from its `preprocessor_config.json` values) with the
    server's quality bounds."""

    def __init__(self, processor_config: dict[str, Any], quality: ImageQuality) -> None:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil,
        )

        keys = ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std")
        self.processor = Qwen2VLImageProcessorPil(
            **{key: processor_config[key] for key in keys if key in processor_config}
        )
        self.quality = quality

    def prepare(self, image: Any, quality: ImageQuality | None = None) -> PreparedImage:
        bounds = self.quality.within(quality)
        size = {"shortest_edge": bounds.min_pixels, "longest_edge": bounds.max_pixels}
        try:
            out = self.processor(images=[image], size=size, return_tensors="pt")
        except ValueError as err:  # an aspect ratio beyond 200:1
            raise ImageInputError(f"the image cannot be resized ({err})") from None
        t, h, w = (int(v) for v in out["image_grid_thw"][0])
        patch, merge = self.processor.patch_size, self.processor.merge_size
        return PreparedImage(
            pixel_values=out["pixel_values"],
            grid_thw=(t, h, w),
            original_size=tuple(image.size),
            resized_size=(w * patch, h * patch),
            tokens=t * h * w // (merge * merge),
        )
