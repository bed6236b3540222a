"""What the model runner asks of the vision side: whether its model has an encoder, which
images a step message must encode (rank 0), the step's image inputs, and whether a prompt's
images fit the model."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from dgpp.engine.errors import InvalidRequestError
from dgpp.engine.vision.spans import PromptImage, check_spans
from dgpp.engine.vision.step_vision import StepVision, VisionInputs

if TYPE_CHECKING:
    from dgpp.engine.configuration.engine_config import EngineConfig
    from dgpp.engine.execution.step_message import StepMessage
    from dgpp.engine.scheduling.scheduler import StepPlan


def vision_for(
    model: nn.Module, config: EngineConfig, device: torch.device, dtype: torch.dtype
) -> StepVision | None:
    """The encoder side of a vision-language model (None for a text-only one)."""
    encoder = getattr(model, "vision_encoder", None)
    if encoder is None:
        return None
    return StepVision(encoder, config.image_cache_tokens, device, dtype)


def with_encodes(vision: StepVision, message: StepMessage, plan: StepPlan) -> StepMessage:
    """`message` with the images its rows read that the encoder cache lacks, and their
    pixels."""
    digests = [span.digest for row in message.rows for span in row.images]
    missing = vision.cache.missing(digests)
    if not missing:
        return message
    images = {image.span.digest: image for c in plan.chunks for image in c.request.images}
    pixels = torch.cat([images[digest].pixel_values for digest in missing])
    return replace(message, encode=missing, pixels=pixels)


def image_inputs(
    vision: StepVision | None, message: StepMessage
) -> tuple[torch.Tensor, VisionInputs] | None:
    """M-RoPE positions [3, T] and image tokens of the message's rows; None without images."""
    if vision is None:
        return None
    rows = [(row.start, row.num_tokens, row.shift, row.images) for row in message.rows]
    return vision.inputs(rows)


def check_prompt_images(
    model: nn.Module,
    vision: StepVision | None,
    prompt_ids: Sequence[int],
    images: Sequence[PromptImage],
) -> None:
    """Refuse images for a text-only model, and spans that are not the prompt's placeholder
    runs (InvalidRequestError)."""
    if vision is None:
        name = getattr(getattr(model, "config", None), "architecture", "this model")
        raise InvalidRequestError(f"{name} does not take images (a text-only model)")
    try:
        check_spans(prompt_ids, [image.span for image in images], model.image_token_id)
    except ValueError as err:
        raise InvalidRequestError(f"images: {err}") from None
    width = vision.encoder.config.patch_dim
    for image in images:
        t, h, w = image.span.patch_grid(vision.merge)
        if tuple(image.pixel_values.shape) != (t * h * w, width):
            raise InvalidRequestError(
                f"image at token {image.span.offset}: pixel_values of shape "
                f"{list(image.pixel_values.shape)}, expected {[t * h * w, width]}"
            )
