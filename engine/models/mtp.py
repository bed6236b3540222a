"""The multi-token-prediction (MTP) layer checkpoints carry beside the model: the draft model of
MTP speculative decoding (issue 37). Two ways of storing it:

- DeepSeek-V3 and GLM-4.5 (`num_nextn_predict_layers`): layer N = num_hidden_layers as
  `model.layers.{N}.*`: `enorm`, `hnorm`, `eh_proj`, the decoder block's tensors, and
  `shared_head.norm` / `shared_head.head` (a copy of the LM head); plain RMSNorms.
- Qwen3-Next and Qwen3.5 (`mtp_num_hidden_layers`): `mtp.pre_fc_norm_embedding`,
  `mtp.pre_fc_norm_hidden`, `mtp.fc`, a full-attention decoder block `mtp.layers.0.*` and
  `mtp.norm`; zero-centred norms; the logits come from the target's own LM head.

At position i it takes the target model's final hidden state h_i (after the final norm) and
the embedding of the next token t_{i+1}, and predicts t_{i+2}:

    x_i = eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)])
    g_i = block(x_i)                        # one decoder layer of the family, own KV cache
    logits_i = head(head_norm(g_i))

The block attends causally over the layer's own cache at the target's positions (same block
tables), so a prompt's pairs (h_i, t_{i+1}) are run through it once, as a prefill. Chaining
(depth > 1) feeds g_i back as the next position's hidden state with the drafted token. The
embedding is the target's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dgpp.engine.backends.base import StepMetadata
from dgpp.engine.configuration.parallel import ParallelContext
from dgpp.engine.layers.embedding import ParallelLMHead
from dgpp.engine.layers.linear import ColumnParallelLinear
from dgpp.engine.layers.norm import RMSNorm


def mtp_layer_count(raw: dict[str, Any]) -> int:
    """The MTP layers a checkpoint's config declares (either family's key). Qwen3-Next's
    released configs declare none but every release carries one (`mtp.*`), as vLLM assumes."""
    declared = raw.get("num_nextn_predict_layers", raw.get("mtp_num_hidden_layers"))
    if declared is None and raw.get("model_type") == "qwen3_next":
        return 1
    return int(declared or 0)


@dataclass(frozen=True)
class MtpNames:
    """Where a family stores its MTP layer: each of the layer's own parts (by module name), the
    decoder block's prefix, and names to skip; `own_head`: the layer has its head (else the
    target's LM head serves)."""

    parts: dict[str, str]
    block: str
    skip: tuple[str, ...] = ()
    own_head: bool = True

    def rename(self, name: str) -> str | None:
        """The layer's name for a checkpoint tensor; None for every other tensor."""
        if name.startswith(self.skip):
            return None
        for mine, stored in self.parts.items():
            if name.startswith(stored + "."):
                return mine + name[len(stored) :]
        if name.startswith(self.block + "."):
            return "block" + name[len(self.block) :]
        return None


def deepseek_mtp_names(index: int) -> MtpNames:
    """Layer `index` as DeepSeek-V3 and GLM-4.5 store it (`model.layers.{index}.*`)."""
    at = f"model.layers.{index}"
    parts = {
        "enorm": f"{at}.enorm",
        "hnorm": f"{at}.hnorm",
        "eh_proj": f"{at}.eh_proj",
        "shared_head_norm": f"{at}.shared_head.norm",
        "shared_head": f"{at}.shared_head.head",
    }
    return MtpNames(parts, at, skip=(f"{at}.embed_tokens.",))  # the target's embedding serves


def qwen_mtp_names(index: int) -> MtpNames:
    """Qwen3-Next's and Qwen3.5's `mtp.*` (their first MTP layer; `index` is unused)."""
    del index
    parts = {
        "enorm": "mtp.pre_fc_norm_embedding",
        "hnorm": "mtp.pre_fc_norm_hidden",
        "eh_proj": "mtp.fc",
        "shared_head_norm": "mtp.norm",
    }
    return MtpNames(parts, "mtp.layers.0", own_head=False)


class MtpLayer(nn.Module):
    """MTP layer `index` of `target` (a `LlamaForCausalLM` family), stored as the target's
    `mtp_names(index)` say: its decoder block is built by the target's `build_mtp_block` (a
    full-attention layer) or else `build_layer`, sharded like the target's layers; its norms
    are the target's `mtp_norm` class."""

    def __init__(
        self, target: nn.Module, parallel: ParallelContext, attention: Any, index: int
    ) -> None:
        super().__init__()
        config = target.config
        self.config = config
        names: MtpNames = getattr(target, "mtp_names", deepseek_mtp_names)(index)
        norm = getattr(target, "mtp_norm", RMSNorm)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = norm(hidden, eps)
        self.hnorm = norm(hidden, eps)
        # Replicated on every rank (2H x H): small beside the block's experts. Kept packed where
        # the checkpoint quantizes it, as any linear.
        packed = config.weight_formats.packed([names.parts["eh_proj"]])
        self.eh_proj = ColumnParallelLinear(2 * hidden, hidden, False, ParallelContext(), packed)
        build = getattr(target, "build_mtp_block", None)
        if build is not None:
            self.block = build(config, parallel, attention, names.block)
        else:
            self.block = target.build_layer(config, parallel, attention, index, names.block)
        self.shared_head_norm = norm(hidden, eps)
        self._head = [target.lm_head]  # the target's (not a submodule), unless stored apart
        if names.own_head:
            self.shared_head = ParallelLMHead(config.vocab_size, hidden, parallel)
            self._head = [self.shared_head]
        # What the loader reads: the target's fused names and expert rule, this layer's names.
        self.packed_modules_mapping = target.packed_modules_mapping
        self.checkpoint_target = getattr(target, "checkpoint_target", None)
        self.checkpoint_name = names.rename
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
        return self._head[0].compute_logits(self.shared_head_norm(hidden), dtype)
