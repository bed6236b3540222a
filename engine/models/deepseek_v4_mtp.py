"""DeepSeek-V4's multi-token-prediction layer (`mtp.0.*` in the release; transformers does not
load it): the draft model of `speculative: mtp` for V4, as DeepSeek's inference code defines it.

At position i it takes the target's residual streams after its last layer h_i [hc, H] (before
the head's last read) and the embedding of the next token t_{i+1}:

    x = e_proj(enorm(embed(t_{i+1}))) + h_proj(hnorm(h_i))     (the embedding added to each stream)
    g = block(x)            a sliding-window V4 layer with its own mHC and experts (scored router)
    logits = head(norm(hc_head(g)))        its own hc_head and norm, the target's embedding and head

Chained drafting feeds g back as the next position's h. Its window's keys are paged (one key
head, sliding window and sinks in the paged backend), so a rejected draft's key is overwritten
by position as any paged key is, and a prefix hit reuses the layer's keys with the target's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dgpp.engine.backends.base import StepMetadata
from dgpp.engine.backends.cache_spec import CacheSpec, PagedKVSpec
from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.configuration.parallel import ParallelContext
from dgpp.engine.layers.mhc import HyperHead
from dgpp.engine.layers.mla import RowSliceLinear
from dgpp.engine.layers.norm import RMSNorm
from dgpp.engine.layers.v4_attention import PagedV4Attention
from dgpp.engine.layers.v4_config import V4Dims

_OWN = ("e_proj.", "h_proj.", "enorm.", "hnorm.", "norm.")


def v4_mtp_name(name: str, rename: Any) -> str | None:
    """The MTP layer's name for a release tensor `mtp.0.*` (`rename`: the target's rule for
    a decoder layer's names); None for every other tensor."""
    if not name.startswith("mtp.0."):
        return None
    rest = name.removeprefix("mtp.0.")
    if rest.startswith(_OWN):
        return rest
    if rest.startswith("hc_head_"):
        return "hc_head.hc_" + rest.removeprefix("hc_head_")
    renamed = rename(f"layers.0.{rest}")
    return None if renamed is None else "block." + renamed.removeprefix("model.layers.0.")


def v4_mtp_cache_specs(config: ModelConfig, parallel: ParallelContext) -> list[CacheSpec]:
    """The layer's window keys, paged (one key head on every rank, its key its own value)."""
    del parallel
    return [PagedKVSpec(1, V4Dims.of(config).head_dim)]


class V4MtpLayer(nn.Module):
    """MTP layer `index` (= num_hidden_layers) of a DeepSeek-V4 `target`."""

    def __init__(
        self, target: nn.Module, parallel: ParallelContext, attention: Any, index: int
    ) -> None:
        super().__init__()
        config: ModelConfig = target.config
        self.config = config
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.enorm, self.hnorm, self.norm = (RMSNorm(hidden, eps) for _ in range(3))
        self.e_proj = RowSliceLinear(hidden, (0, hidden), bias=False)  # replicated: H x H
        self.h_proj = RowSliceLinear(hidden, (0, hidden), bias=False)
        streams = int(config.raw.get("hc_mult") or 4)
        hc_eps = float(config.raw.get("hc_eps") or 1e-6)
        self.hc_head = HyperHead(streams, hidden, hc_eps, eps)
        self_attn = PagedV4Attention(target.dims, index, parallel, attention, config)
        self.block = target.decoder_layer(
            config, self_attn, target.build_moe(config, parallel, index)
        )
        self._embed = [target.model.embed_tokens]  # the target's (not submodules)
        self._rotary = [target.model.rotary]  # a sliding layer: the main rotary
        self._head = [target.lm_head]
        self.packed_modules_mapping = target.packed_modules_mapping
        self._target_rule = target.checkpoint_target
        self._rename = target.checkpoint_name

    def checkpoint_name(self, name: str) -> str | None:
        return v4_mtp_name(name, self._rename)

    def checkpoint_target(self, name: str) -> tuple[str, Any] | None:
        """The sinks live in the paged attention; every other rule is the target's."""
        if name.endswith(".self_attn.sinks"):
            return name.replace(".self_attn.sinks", ".self_attn.attn.sinks"), None
        rule: tuple[str, Any] | None = self._target_rule(name)
        return rule

    def forward(
        self,
        previous_hidden: torch.Tensor,
        next_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: StepMetadata,
    ) -> torch.Tensor:
        """previous_hidden [T, hc, H] (the target's streams, or this layer's when chaining) ->
        the layer's streams [T, hc, H]."""
        embedded = self.e_proj(self.enorm(self._embed[0](next_ids)))
        streams = embedded.unsqueeze(1) + self.h_proj(self.hnorm(previous_hidden))
        angles = self._rotary[0].lookup(positions, streams.dtype)
        out: torch.Tensor = self.block(angles, streams, metadata, next_ids)
        return out

    def compute_logits(
        self, hidden: torch.Tensor, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """The draft's logits [T, padded_vocab] from the layer's streams."""
        return self._head[0].compute_logits(self.norm(self.hc_head(hidden)), dtype)
