"""The interface between multi-head latent attention layers and their backends."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from dgpp.engine.backends.base import AttentionBackend


class MLABackend(AttentionBackend, Protocol):
    """Multi-head latent attention over a paged latent cache [blocks, block_size, L + R] per
    layer (`dgpp.engine.backends.cache_spec.MLALatentSpec`)."""

    def forward(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent: torch.Tensor,
        cache: torch.Tensor,
        kv_b: torch.Tensor,
        metadata: Any,
        scale: float,
    ) -> torch.Tensor:
        """Store latent [T, L + R] (normalised compressed key/value, then the rotated rope key)
        at the step's slots, then attend with q_nope [T, H, N] and rotated q_pe [T, H, R];
        kv_b [H, N + V, L] is this rank's key/value up-projection. Returns [T, H, V]."""
        ...
