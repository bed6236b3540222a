"""The multi-token-prediction (MTP) layer DeepSeek-V3 and GLM-4.5 checkpoints append
(`num_nextn_predict_layers`, stored as `model.layers.{N}.*` for N >= num_hidden_layers): the
draft model of MTP speculative decoding (issue 37).

At position i it takes the target model's final hidden state h_i (after the final norm) and
the embedding of the next token t_{i+1}, and predicts t_{i+2}:

    x_i = eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)])
    g_i = block(x_i)                        # one decoder layer of the family, own KV cache
    logits_i = shared_head(shared_head.norm(g_i))

The block attends causally over the layer's own cache at the target's positions (same block
tables), so a prompt's pairs (h_i, t_{i+1}) are run through it once, as a prefill. Chaining
(depth > 1) feeds g_i back as the next position's hidden state with the drafted token. The
embedding is the target's; the head is the checkpoint's `shared_head.head` (a copy of the LM
head in released checkpoints).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from dgpp.engine.backends.base import StepMetadata
from dgpp.engine.layers.embedding import ParallelLMHead
from dgpp.engine.layers.linear import ColumnParallelLinear
from dgpp.engine.layers.norm import RMSNorm
from dgpp.engine.parallel import ParallelContext

_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")


def mtp_checkpoint_name(index: int) -> Any:
    """The loader's name rule for MTP layer `index`'s tensors (`model.layers.{index}.*`): the
    layer's own parts by their names, the decoder block's under `block.`, the others (the main
    model's, and the duplicated embedding) skipped."""
    prefix = re.compile(rf"^model\.layers\.{index}\.(.*)$")

    def rename(name: str) -> str | None:
        found = prefix.match(name)
        if found is None:
            return None
        rest = found.group(1)
        if rest.startswith("embed_tokens."):
            return None  # the target's embedding serves
        if rest.startswith("shared_head.head."):
            return "shared_head." + rest[len("shared_head.head.") :]
        if rest.startswith("shared_head.norm."):
            return "shared_head_norm." + rest[len("shared_head.norm.") :]
        return rest if rest.startswith(_OWN) else f"block.{rest}"

    return rename


class MtpLayer(nn.Module):
    """MTP layer `index` of `target` (a `LlamaForCausalLM` family): its decoder block is built
    by the target's own `build_layer`, sharded like the target's layers."""

    def __init__(
        self, target: nn.Module, parallel: ParallelContext, attention: Any, index: int
    ) -> None:
        super().__init__()
        config = target.config
        self.config = config
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(hidden, eps)
        self.hnorm = RMSNorm(hidden, eps)
        # Replicated on every rank (2H x H): small beside the block's experts. Kept packed where
        # the checkpoint quantizes it, as any linear.
        stored = f"model.layers.{index}.eh_proj"
        packed = config.weight_formats.packed([stored])
        self.eh_proj = ColumnParallelLinear(2 * hidden, hidden, False, ParallelContext(), packed)
        self.block = target.build_layer(config, parallel, attention, index, f"model.layers.{index}")
        self.shared_head_norm = RMSNorm(hidden, eps)
        self.shared_head = ParallelLMHead(config.vocab_size, hidden, parallel)
        # What the loader reads: the target's fused names and expert rule, this layer's names.
        self.packed_modules_mapping = target.packed_modules_mapping
        self.checkpoint_target = getattr(target, "checkpoint_target", None)
        self.checkpoint_name = mtp_checkpoint_name(index)
        self._embed = [target.model.embed_tokens]  # not a submodule: the target owns it
        self._rotary = [target.model.rotary]

    def forward(
        self,
        previous_hidden: torch.Tensor,
        next_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: StepMetadata,
    ) -> torch.Tensor:
        """previous_hidden [T, H] (the target's final hidden states, or this layer's output when
        chaining), next_ids [T] (the token after each position), positions [T] -> the layer's
        hidden states [T, H] (before `shared_head_norm`)."""
        embedded = self.enorm(self._embed[0](next_ids))
        x = self.eh_proj(torch.cat((embedded, self.hnorm(previous_hidden)), dim=-1))
        angles = self._rotary[0].lookup(positions, x.dtype)
        return self.block(angles, x, metadata)

    def compute_logits(
        self, hidden: torch.Tensor, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """The draft's logits [T, padded_vocab] from the layer's hidden states."""
        return self.shared_head.compute_logits(self.shared_head_norm(hidden), dtype)
