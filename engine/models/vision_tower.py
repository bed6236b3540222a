"""The vision tower of the Qwen vision-language checkpoints, attached to a decoder family's
model where the checkpoint stores it (`model.visual`), so its weights load under their own
names; the runner finds it through the model's `vision_encoder`."""

from __future__ import annotations

from torch import nn

from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.vision.qwen_vision import QwenVisionEncoder, VisionConfig

_LANGUAGE_MODEL = "model.language_model."


def vl_checkpoint_name(name: str) -> str:
    """A vision-language checkpoint's names as the model's: the language model's without their
    prefix, the vision tower's (`model.visual.*`) as they are."""
    if name.startswith(_LANGUAGE_MODEL):
        return "model." + name[len(_LANGUAGE_MODEL) :]
    return name


def attach_vision(model: nn.Module, config: ModelConfig) -> None:
    """Give `model` the checkpoint's vision tower and its image token, when the config has a
    `vision_config` (a `…ForConditionalGeneration` checkpoint)."""
    raw = config.raw.get("vision_config")
    if not isinstance(raw, dict):
        return
    model.model.visual = QwenVisionEncoder(VisionConfig.from_dict(raw))
    model.image_token_id = int(config.raw["image_token_id"])


def vision_encoder(model: nn.Module) -> QwenVisionEncoder | None:
    """The model's vision tower; None for a text-only one."""
    return getattr(model.model, "visual", None)
