"""Qwen4-Exp's hyper-connections: the residual stream widened to `hc_count` streams, each
block reading a learned mix of them and writing its output back into each with a learned
weight (transformers' `Qwen4ExpTextGatedResidual`).

Before a block, the streams x [T, n * H] are normalised per stream (zero-centred RMSNorm in
groups of H); the block's input is the mean over streams of the normalised streams weighted by
`sigmoid(up(silu(down(x_n) / n)))`; after it, stream i gains the output times
`2 * sigmoid(inject(x_n) / n)[i]`. The model starts with n copies of the embedding and ends
with one more mix (no injection) in place of a final norm. Replicated on every rank: the mixes
are small ([n * H, rank] and back) beside the blocks they feed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dgpp.engine.backends.base import StepMetadata
from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.layers.mla import RowSliceLinear
from dgpp.engine.layers.norm import ZeroCentredRMSNorm
from dgpp.engine.layers.ple import PerLayerEmbedding
from dgpp.engine.layers.rotary import RopeAngles


class HyperConnection(nn.Module):
    """One block's read (`mix`) and write (`inject`) of the streams."""

    def __init__(self, config: ModelConfig, combine: bool = True) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.streams = int(config.raw.get("hc_count", 4))
        rank = int(config.raw.get("hc_lowrank", 320))
        width = self.streams * hidden
        self.hc_norm = ZeroCentredRMSNorm(width, config.rms_norm_eps, hidden)
        self.input_mix_weight_down = RowSliceLinear(width, (0, rank), bias=False)
        self.input_mix_weight_up = RowSliceLinear(rank, (0, width), bias=False)
        self.block_inject_weight = (
            RowSliceLinear(width, (0, self.streams), bias=False) if combine else None
        )

    def mix(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The block's input [T, H] from streams [T, n * H], and the injection weights [T, n]
        (None without injection)."""
        n = self.streams
        normed = self.hc_norm(streams)
        weights = F.silu(self.input_mix_weight_down(normed) / n)
        weights = torch.sigmoid(self.input_mix_weight_up(weights)).unflatten(-1, (n, -1))
        mixed = (weights * normed.unflatten(-1, (n, -1))).mean(dim=-2)
        if self.block_inject_weight is None:
            return mixed, None
        return mixed, 2 * torch.sigmoid(self.block_inject_weight(normed) / n)

    @staticmethod
    def inject(streams: torch.Tensor, out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """streams plus the block's output [T, H] scaled per stream by weights [T, n]."""
        return streams + (out.unsqueeze(-2) * weights.unsqueeze(-1)).flatten(-2)


class HyperDecoderLayer(nn.Module):
    """A decoder layer over the streams: PLE (if any), the token mixer (`self_attn` or
    `linear_attn`) and the MLP, each through its hyper-connection."""

    def __init__(
        self,
        config: ModelConfig,
        mixer: nn.Module,
        mixer_name: str,
        mlp: nn.Module,
        ple: PerLayerEmbedding | None,
    ) -> None:
        super().__init__()
        self.ple = ple
        self.mixer_name = mixer_name
        self.add_module(mixer_name, mixer)
        self.mlp = mlp
        self.attn_hyper_connection = HyperConnection(config)
        self.mlp_hyper_connection = HyperConnection(config)

    def forward(
        self,
        angles: RopeAngles,
        streams: torch.Tensor,
        metadata: StepMetadata,
        input_ids: torch.Tensor,
    ) -> torch.Tensor:
        if self.ple is not None:
            streams = streams + self.ple(streams, input_ids, metadata)
        mixed, weights = self.attn_hyper_connection.mix(streams)
        assert weights is not None
        out = self._modules[self.mixer_name](angles, mixed, metadata)
        streams = HyperConnection.inject(streams, out, weights)
        mixed, weights = self.mlp_hyper_connection.mix(streams)
        assert weights is not None
        return HyperConnection.inject(streams, self.mlp(mixed), weights)
