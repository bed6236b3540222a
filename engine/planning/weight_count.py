"""Bytes of the weights one rank holds, counted on the model built on the meta device."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import torch

from dgpp.engine.backends.torch_paged import TorchPagedAttention
from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.configuration.parallel import ParallelContext
from dgpp.engine.layers.head_partition import partition_heads
from dgpp.engine.layers.moe import PackedExperts
from dgpp.engine.models.moe_blocks import COUNTING_ONLY
from dgpp.engine.models.mtp import mtp_layer_count
from dgpp.engine.models.registry import build_model


def rank_weight_bytes(
    model: ModelConfig, tp_size: int, tp_rank: int, dtype_bytes: int, mtp: bool = False
) -> int:
    """Bytes of the parameters rank `tp_rank` holds, counted on the model itself built on the
    meta device (no memory): every family's layers, packed weights in their packed bytes, float
    parameters in the run dtype, a tied LM head once; with `mtp`, the MTP layer's too."""
    floats, packed = _weight_counts(model, tp_size, tp_rank, mtp)
    return floats * dtype_bytes + packed


def uses_mtp(speculative: str, model: ModelConfig) -> bool:
    """Whether the engine builds the checkpoint's MTP layer (`speculative: mtp` on a checkpoint
    that declares one; the runner refuses the knob on any other)."""
    return speculative == "mtp" and mtp_layer_count(model.raw) > 0


_COUNTS: OrderedDict[tuple[str, str, int, object, bool], tuple[int, int]] = OrderedDict()
_COUNTS_LOCK = threading.Lock()


def head_shares(model: ModelConfig, tp_size: int, tp_rank: int) -> tuple[int, ...] | int:
    """What makes one rank's parameter shapes differ from another's: only the attention heads it
    holds (`partition_heads`, which may deal them unevenly); every other split is even
    (`ParallelContext.shard` refuses one that is not) and differs between ranks only in its
    offset. Ranks with equal shares hold equally many parameters. The rank itself where the
    heads cannot be partitioned (the build will say why)."""
    try:
        grouped = partition_heads(model.num_heads, model.num_kv_heads, tp_size, tp_rank)
        latent = partition_heads(model.num_heads, model.num_heads, tp_size, tp_rank)
    except ValueError:
        return tp_rank
    return grouped.num_q, grouped.num_kv, latent.num_q


def _weight_counts(
    model: ModelConfig, tp_size: int, tp_rank: int, mtp: bool = False
) -> tuple[int, int]:
    """(float parameters, bytes of the others) of one rank, remembered per configuration and
    head share (ranks with the same share count once): a large MoE takes seconds to build even
    on the meta device (DeepSeek-V3: 9 s a rank, 14,906 expert modules), and a plan, the
    console's previews and `dgpp deploy plan` ask again and again."""
    # The raw config too: layer kinds and widths some families read from it are not typed
    # fields (Qwen3-Next's `mlp_only_layers`, its linear-attention heads), so not in the repr.
    raw = json.dumps(model.raw, sort_keys=True, default=str)
    key = (repr(model), raw, tp_size, head_shares(model, tp_size, tp_rank), mtp)
    with _COUNTS_LOCK:
        if key in _COUNTS:
            _COUNTS.move_to_end(key)
            return _COUNTS[key]
    floats, packed = count_weights(model, tp_size, tp_rank, mtp)
    with _COUNTS_LOCK:
        _COUNTS[key] = (floats, packed)
        while len(_COUNTS) > 32:
            _COUNTS.popitem(last=False)
    return floats, packed


def count_weights(
    model: ModelConfig, tp_size: int, tp_rank: int, mtp: bool = False
) -> tuple[int, int]:
    """(float parameters, bytes of the others) of rank `tp_rank`, built on the meta device
    (with `mtp`, the MTP layer built beside it)."""
    from dgpp.engine.models.mtp import MtpLayer

    parallel = ParallelContext(tp_rank=tp_rank, tp_size=tp_size)
    meta = torch.device("meta")
    counting = COUNTING_ONLY.set(True)
    try:
        with meta:
            built = build_model(model, parallel, 1, TorchPagedAttention(meta))
            parts = [built]
            if mtp:
                layer = getattr(built, "mtp_layer", MtpLayer)
                parts.append(layer(built, parallel, TorchPagedAttention(meta), model.num_layers))
    finally:
        COUNTING_ONLY.reset(counting)
    floats = packed = 0
    for param, times in _counted(parts):
        if param.is_floating_point():
            floats += param.numel() * times
        else:
            packed += param.numel() * param.element_size() * times
    return floats, packed


def _counted(parts: list[torch.nn.Module]) -> list[tuple[torch.nn.Parameter, int]]:
    """Each part's parameters once (a tied LM head once), and the experts `COUNTING_ONLY` put
    in every slot of a `PackedExperts` once more per slot beyond the first."""
    found = [(param, 1) for part in parts for param in part.parameters()]
    for part in parts:
        for module in part.modules():
            if isinstance(module, PackedExperts) and len(module) > 1:
                first = module[0]
                if all(expert is first for expert in module):
                    found += [(param, len(module) - 1) for param in first.parameters()]
    return found
