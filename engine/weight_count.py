"""Bytes of the weights one rank holds, counted on the model built on the meta device."""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from dgpp.engine.backends.torch_paged import TorchPagedAttention
from dgpp.engine.config import ModelConfig
from dgpp.engine.models.registry import build_model
from dgpp.engine.parallel import ParallelContext


def rank_weight_bytes(model: ModelConfig, tp_size: int, tp_rank: int, dtype_bytes: int) -> int:
    """Bytes of the parameters rank `tp_rank` holds, counted on the model itself built on the
    meta device (no memory): every family's layers, packed weights in their packed bytes, float
    parameters in the run dtype, a tied LM head once."""
    floats, packed = _weight_counts(model, tp_size, tp_rank)
    return floats * dtype_bytes + packed


_COUNTS: OrderedDict[tuple[str, int, int], tuple[int, int]] = OrderedDict()
_COUNTS_LOCK = threading.Lock()


def _weight_counts(model: ModelConfig, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """(float parameters, bytes of the others) of one rank, remembered per configuration: a
    large MoE takes seconds to build even on the meta device (GLM-4.5: 8 s, 74,545 expert
    modules), and a plan, the console's previews and `dgpp deploy plan` ask again and again."""
    key = (repr(model), tp_size, tp_rank)  # every field that shapes the model, by value
    with _COUNTS_LOCK:
        if key in _COUNTS:
            _COUNTS.move_to_end(key)
            return _COUNTS[key]
    parallel = ParallelContext(tp_rank=tp_rank, tp_size=tp_size)
    meta = torch.device("meta")
    with meta:
        built = build_model(model, parallel, 1, TorchPagedAttention(meta))
    floats = packed = 0
    for param in built.parameters():
        if param.is_floating_point():
            floats += param.numel()
        else:
            packed += param.numel() * param.element_size()
    with _COUNTS_LOCK:
        _COUNTS[key] = (floats, packed)
        while len(_COUNTS) > 32:
            _COUNTS.popitem(last=False)
    return floats, packed
