"""A decoder served as an embedding model (`engine.kind: embed`): the model's head returns the last
token's final hidden state (after the final norm) instead of logits, as Qwen3-Embedding and the
other last-token-pooling embedders are trained. Normalization and Matryoshka truncation are the
request's (`dgpp.engine.scheduling.step_pooling`).

Such checkpoints are saved from the bare decoder (`Qwen3Model`): their tensors are named without
the `model.` prefix and carry no `lm_head`; both forms load.
"""

from __future__ import annotations

import torch
from torch import nn


class PooledHidden(nn.Module):
    """The head of an embedding model: no weights; the hidden states as float32 "logits"
    [N, hidden]."""

    def compute_logits(
        self, hidden: torch.Tensor, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        return hidden.float()


def adapt_for_kind(model: nn.Module, kind: str) -> nn.Module:
    """`model` as `kind` serves it: an embedding model's LM head gives way to `PooledHidden`
    (its weights are neither built nor read); a reranker keeps its head (its yes/no logits).
    An encoder pools by itself, as the kind its class serves (`models.bert`; `resolve` refuses
    another)."""
    if getattr(model, "whole_prompts", False):
        return model
    if kind != "embed":
        return model
    if not isinstance(getattr(model, "lm_head", None), nn.Module):
        raise TypeError(f"{type(model).__name__} has no LM head to pool in place of")
    model.lm_head = PooledHidden()
    own = getattr(model, "checkpoint_name", None)

    def checkpoint_name(name: str) -> str | None:
        if name.startswith("lm_head."):
            return None
        if not name.startswith("model."):
            name = f"model.{name}"
        return own(name) if own is not None else name

    model.checkpoint_name = checkpoint_name  # type: ignore[method-assign]
    return model


def image_architecture(architecture: str, kind: str) -> str:
    """What names the model's weights in a resident image: an embedding model's lack the head."""
    return f"{architecture}+embed" if kind == "embed" else architecture
