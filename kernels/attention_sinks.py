"""Attention sinks (gpt-oss): a learned logit per head that joins every softmax's denominator and
adds no value, so a head can give part of its weight to nothing.

`F.scaled_dot_product_attention` takes no extra denominator term and returns no log-sum-exp, so
the sink enters as one more key: a zero key (its score q . 0 is 0) with a zero value, and an
additive bias equal to the head's sink on that key's column. The softmax over the scores and the
sink is then exactly exp(s_j) / (sum_k exp(s_k) + exp(sink)), and the zero value adds nothing,
all inside the fused kernel. The alternatives cost more: an explicit softmax runs unfused on
float32 scores (2-3x slower than this for a 512-token chunk on a 2-core CPU, where this takes
1.3-2x the sinkless kernel's time); rescaling the output by 1 / (1 + exp(sink - lse)) needs the
log-sum-exp, which only private, device-specific ops return, and computing it apart is a second
pass over q . k. The price here is the bias, [.., H, Q, S + 1] in the compute dtype: one score
matrix, which the memory plan budgets for every layer already. Prefill appends the zero key and
value (`sdpa_with_sinks`); decode gathers one more slot per row and zeroes it (no second copy).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sink_bias(visible: torch.Tensor, sinks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask for keys [S] followed by the sink's zero key: 0 where `visible`
    [..., Q, S] (bool, broadcast over heads), -inf elsewhere, and sinks [H] on column S; returns
    [..., H, Q, S + 1] with the leading dims of `visible` before its last two."""
    num_keys = visible.shape[-1]
    visible = F.pad(visible, (0, 1), value=True)  # [..., Q, S + 1]; the sink is always seen
    column = torch.zeros(sinks.shape[0], 1, num_keys + 1, dtype=dtype, device=visible.device)
    column[:, 0, num_keys] = sinks.to(dtype)  # [H, 1, S + 1]
    return torch.where(visible.unsqueeze(-3), column, float("-inf"))


def sdpa_with_sinks(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    visible: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of query [B, H, Q, D] over key/value [B, H_kv, S, D] (heads grouped), where
    query q sees key s if `visible` [..., Q, S], with a sink per head [H]; returns [B, H, Q, D]."""
    key = torch.cat((key, key.new_zeros(*key.shape[:2], 1, key.shape[3])), dim=2)
    value = torch.cat((value, value.new_zeros(*value.shape[:2], 1, value.shape[3])), dim=2)
    bias = sink_bias(visible, sinks, query.dtype)
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=bias, scale=scale, enable_gqa=True
    )
