"""A rank's model, built and filled: from its resident weight image when one is usable, else from
the checkpoint (then the image is written); the checkpoint's static KV scales settled after."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dgpp.engine.backends.base import AttentionBackend
from dgpp.engine.backends.selection import select_backend_for
from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.checkpoint.loader import load_weights
from dgpp.engine.configuration.engine_config import EngineConfig
from dgpp.engine.configuration.parallel import ParallelContext
from dgpp.engine.layers.attention import expect_kv_scales, settle_kv_scales
from dgpp.engine.models.pooling import image_architecture
from dgpp.engine.models.registry import build_model
from dgpp.engine.planning.resident_cache import image_key, load_resident


def load_model(
    config: EngineConfig,
    model_config: ModelConfig,
    parallel: ParallelContext,
    checkpoint: Path,
    max_model_len: int,
    where: tuple[torch.device, torch.dtype],
    resident_dir: Path | None,
) -> tuple[nn.Module, AttentionBackend, bool]:
    """(the model on the CPU in the run dtype, its attention backend, whether its weights came
    warm from an image)."""
    device, dtype = where
    attention = select_backend_for(model_config, device, dtype, config.kv_cache_dtype)
    with torch.device("cpu"):
        model = build_model(model_config, parallel, max_model_len, attention, config.kind)
    model = model.to(dtype)
    expect_kv_scales(model, model_config.kv_scales)  # float32, after the dtype change
    warm = False
    own_dir = config.resident_cache_dir
    image_dir = Path(own_dir).expanduser() if own_dir is not None else resident_dir
    if config.resident_cache and image_dir is not None:
        key = image_key(
            checkpoint, parallel.tp_rank, parallel.tp_size, config.resolved_dtype,
            device.type, image_architecture(model_config.architecture, config.kind),
        )  # fmt: skip
        warm = load_resident(model, checkpoint, key, image_dir)
    else:
        load_weights(model, checkpoint)
    settle_kv_scales(model, config.kv_cache_dtype)
    attach_tables = getattr(model, "attach_tables", None)  # Qwen4-Exp's disk-backed tables
    if attach_tables is not None:
        attach_tables(checkpoint, config.ngram_tables_in_memory)
    return model, attention, warm
