"""Images of a chat request, from their parts to the prompt: every API's image parts arrive as
chat content parts (`image_url`; Anthropic's `image` blocks and the Responses API's
`input_image` items are converted to them), the template writes one placeholder per image, and
`ServerImages` decodes and resizes each (`dgpp.engine.vision.images`) and widens its
placeholder to the image's vision tokens (`expand`), recording each image's span for the
engine (`dgpp.engine.scheduling.request.PromptIds.images`).

The quality bounds: the checkpoint's image processor's `size` (shortest and longest edge, in
pixels), narrowed by the server's `http.image_min_pixels` / `http.image_max_pixels`; a request
may ask for other bounds within them (`mm_processor_kwargs`: `min_pixels`, `max_pixels`, as
vLLM takes them).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.errors import InvalidRequestError
from dgpp.engine.scheduling.request import PromptIds
from dgpp.engine.server.chat.coordinates import RELATIVE
from dgpp.engine.server.core.config import ServerConfig
from dgpp.engine.vision.images import (
    ImageInputError,
    ImageLimits,
    ImagePreparer,
    ImageQuality,
    PreparedImage,
    decode_image,
    image_bytes,
)
from dgpp.engine.vision.spans import ImageSpan, PromptImage, image_digest

IMAGE_PARTS = ("image_url", "input_image", "image")


def part_url(part: Any, where: str) -> str:
    """The URL (data: or http(s)) of an image content part."""
    value = getattr(part, "image_url", None)
    if isinstance(value, Mapping):
        value = value.get("url")
    elif value is not None and not isinstance(value, str):
        value = getattr(value, "url", None)
    if not isinstance(value, str) or not value:
        raise InvalidRequestError("an image part needs image_url.url (a URL string)", param=where)
    return value


class ServerImages:
    """Rank 0's image front for a vision-language checkpoint."""

    def __init__(self, checkpoint: Path, model: ModelConfig) -> None:
        path = checkpoint / "preprocessor_config.json"
        try:
            processor = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise InvalidRequestError(f"images need the checkpoint's {path.name} ({err})") from None
        size = processor.get("size") or {}
        low = int(size.get("shortest_edge") or processor.get("min_pixels") or 56 * 56)
        high = int(size.get("longest_edge") or processor.get("max_pixels") or 28 * 28 * 1280)
        self.checkpoint_quality = ImageQuality(low, high)
        self.preparer = ImagePreparer(processor, self.checkpoint_quality)
        self.image_token = int(model.raw["image_token_id"])
        self.merge = self.preparer.processor.merge_size
        # How the served families write grounding coordinates: Qwen3-VL and Qwen3.5 on a
        # 0-1000 grid over the image (`dgpp.engine.server.chat.coordinates`).
        self.convention = RELATIVE

    def bounds(self, config: ServerConfig) -> ImageQuality:
        """The server's quality bounds: the checkpoint's, narrowed by the knobs."""
        base = self.checkpoint_quality
        low = config.image_min_pixels or base.min_pixels
        high = config.image_max_pixels or base.max_pixels
        return ImageQuality(min(low, high), high)

    def prepare(
        self,
        urls: Sequence[str],
        config: ServerConfig,
        override: Mapping[str, Any] | None,
        where: str = "messages",
    ) -> list[PreparedImage]:
        """Each image decoded, checked and resized (400s name the image's index)."""
        if len(urls) > config.max_images_per_request:
            raise InvalidRequestError(
                f"{len(urls)} images in one request; the server takes at most "
                f"{config.max_images_per_request} (http.max_images_per_request)",
                param=where,
            )
        quality = self.bounds(config).within(request_quality(override))
        limits = ImageLimits(
            fetch_urls=config.image_url_fetch, fetch_timeout_s=config.image_fetch_timeout_s
        )
        prepared = []
        for index, url in enumerate(urls):
            try:
                image = decode_image(image_bytes(url, limits), limits)
                prepared.append(self.preparer.prepare(image, quality))
            except ImageInputError as err:
                raise InvalidRequestError(f"image {index}: {err}", param=where) from None
        return prepared

    def expand(self, prompt: PromptIds, prepared: Sequence[PreparedImage]) -> PromptIds:
        """`prompt` with each image placeholder widened to its image's tokens, in order."""
        ids: list[int] = []
        images: list[PromptImage] = []
        pending = iter(prepared)
        widened: list[tuple[int, int]] = []  # (placeholder's index, tokens added there)
        for index, token in enumerate(prompt):
            if token != self.image_token:
                ids.append(token)
                continue
            image = next(pending, None)
            if image is None:
                raise InvalidRequestError(
                    "the chat template wrote more image placeholders than the request has "
                    "images (is an image token in the text?)",
                    param="messages",
                )
            t, h, w = image.grid_thw
            span = ImageSpan(len(ids), t, h // self.merge, w // self.merge, digest(image))
            images.append(
                PromptImage(span, image.pixel_values, image.original_size, image.resized_size)
            )
            ids += [token] * span.tokens
            widened.append((index, span.tokens - 1))
        if next(pending, None) is not None:
            raise InvalidRequestError(
                "the chat template left an image out (images where this model's template "
                "writes none?)",
                param="messages",
            )
        hints = [h + sum(n for at, n in widened if at < h) for h in prompt.cache_hints]
        return PromptIds(ids, hints, images)


def server_images(engine: Any) -> ServerImages | None:
    """The image front of `engine`'s model: None for a text-only one, and (with a warning) for
    a vision-language checkpoint without its image processor's settings."""
    if getattr(getattr(engine, "runner", None), "vision", None) is None:
        return None  # a text-only model (or a stand-in engine without a runner)
    try:
        return ServerImages(engine.checkpoint, engine.model_config)
    except InvalidRequestError as err:
        logging.getLogger(__name__).warning("serving text only: %s", err)
        return None


def digest(image: PreparedImage) -> int:
    return image_digest(image.pixel_values, image.grid_thw)


def request_quality(override: Mapping[str, Any] | None) -> ImageQuality | None:
    """A request's quality bounds (`mm_processor_kwargs`), None when it asks for none."""
    if not override:
        return None
    unknown = set(override) - {"min_pixels", "max_pixels"}
    if unknown:
        raise InvalidRequestError(
            f"mm_processor_kwargs takes min_pixels and max_pixels, not {sorted(unknown)}",
            param="mm_processor_kwargs",
        )
    values = {}
    for key in ("min_pixels", "max_pixels"):
        value = override.get(key)
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 1
        ):
            raise InvalidRequestError(
                f"mm_processor_kwargs.{key} must be a positive integer", param="mm_processor_kwargs"
            )
        values[key] = value
    low = values["min_pixels"] or 1
    high = values["max_pixels"] or 1 << 40
    if low > high:
        raise InvalidRequestError(
            "mm_processor_kwargs.min_pixels exceeds max_pixels", param="mm_processor_kwargs"
        )
    return ImageQuality(low, high)
