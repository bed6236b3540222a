"""DeepSeek-V4's key compressors: every window of `rate` consecutive tokens becomes one key (its
keys are its values), pooled with a softmax over the window's slots per channel.

A token t contributes a projection c_t and a gate z_t (`kv_proj`, `gate_proj`). Window w, tokens
w * rate .. (w + 1) * rate - 1, closes when its last token arrives and yields

    e_w = rope(kv_norm(sum_j softmax_j(z_j + B_j) * c_j), position w * rate)

with B the learned `position_bias` [rate, F]. Heavily compressed attention (rate 128) pools the
window's own tokens. Compressed sparse attention (rate 4) and its indexer overlap windows: the
projections are twice as wide, the first half (Ca) of window w - 1's tokens and the second half
(Cb) of window w's pool together over 2 * rate slots (window 0's missing predecessor has weight
zero). (docs/deepseek_v4.md, section 3.)

A request's state between steps is a `CompressorCarry`: the raw projections of the tokens since
the last closed window (fewer than `rate`) and, overlapping, the last closed window's Ca half
(its gate with the bias added). `compress` takes a chunk of tokens and the carry and returns the
keys of the windows the chunk closes and the carry after it, so chunked prefill and decode give
the keys a whole sequence does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from dgpp.engine.layers.deepseek_v4_parts import rotate_trailing_pairs
from dgpp.engine.layers.mla import RowSliceLinear
from dgpp.engine.layers.norm import RMSNorm
from dgpp.engine.layers.rotary import RotaryEmbedding


@dataclass(frozen=True)
class CompressorCarry:
    """What a request's compressor keeps between steps (see the module's docstring)."""

    pending_kv: torch.Tensor  # [n < rate, F]
    pending_gate: torch.Tensor  # [n < rate, F], without the position bias
    prior_kv: torch.Tensor | None = None  # overlapping: the last closed window's Ca [rate, D]
    prior_gate: torch.Tensor | None = None  # [rate, D] float32, with the bias
    windows: int = 0  # windows closed so far: the next one starts at windows * rate


class WindowCompressor(nn.Module):
    """`kv_proj`, `gate_proj`, `position_bias` and `kv_norm` of one compressor (replicated on
    every rank: its keys serve every head)."""

    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool, eps: float) -> None:
        super().__init__()
        self.dim, self.rate, self.overlap = dim, rate, overlap
        width = 2 * dim if overlap else dim
        self.kv_proj = RowSliceLinear(hidden, (0, width), bias=False)
        self.gate_proj = RowSliceLinear(hidden, (0, width), bias=False)
        self.position_bias = nn.Parameter(torch.zeros(rate, width), requires_grad=False)
        self.kv_norm = RMSNorm(dim, eps)

    def empty_carry(self, like: torch.Tensor) -> CompressorCarry:
        width = self.kv_proj.weight.shape[0]
        return CompressorCarry(like.new_zeros(0, width), like.new_zeros(0, width))

    def compress(
        self, hidden: torch.Tensor, carry: CompressorCarry, rotary: RotaryEmbedding
    ) -> tuple[torch.Tensor, CompressorCarry]:
        """The keys [closed windows, dim] of the windows `hidden` [T, H] closes after `carry`,
        and the carry after it."""
        kv = torch.cat((carry.pending_kv, self.kv_proj(hidden)))
        gate = torch.cat((carry.pending_gate, self.gate_proj(hidden)))
        rate, dim = self.rate, self.dim
        windows = kv.shape[0] // rate
        usable = windows * rate
        rest = CompressorCarry(kv[usable:], gate[usable:], carry.prior_kv, carry.prior_gate)
        if not windows:
            return kv.new_zeros(0, dim), replace(rest, windows=carry.windows)
        kv = kv[:usable].view(windows, rate, -1)
        gate = gate[:usable].view(windows, rate, -1).float() + self.position_bias.float()
        prior_kv, prior_gate = carry.prior_kv, carry.prior_gate
        if self.overlap:
            kv, gate, prior_kv, prior_gate = self._overlapping(kv, gate, carry)
        weights = torch.softmax(gate, dim=1).to(kv.dtype)
        pooled = self.kv_norm((kv * weights).sum(dim=1))  # [windows, dim]
        first = carry.windows * rate
        positions = torch.arange(windows, device=hidden.device) * rate + first
        keys = rotate_trailing_pairs(pooled[:, None], rotary.lookup(positions, pooled.dtype))[:, 0]
        after = replace(rest, prior_kv=prior_kv, prior_gate=prior_gate)
        return keys, replace(after, windows=carry.windows + windows)

    def _overlapping(
        self, kv: torch.Tensor, gate: torch.Tensor, carry: CompressorCarry
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """2 * rate slots per window: the previous window's Ca, then this window's Cb."""
        dim, rate = self.dim, self.rate
        windows = kv.shape[0]
        slots_kv = kv.new_zeros(windows, 2 * rate, dim)
        slots_gate = gate.new_full((windows, 2 * rate, dim), float("-inf"))
        slots_kv[:, rate:], slots_gate[:, rate:] = kv[..., dim:], gate[..., dim:]
        slots_kv[1:, :rate], slots_gate[1:, :rate] = kv[:-1, :, :dim], gate[:-1, :, :dim]
        if carry.prior_kv is not None and carry.prior_gate is not None:
            slots_kv[0, :rate], slots_gate[0, :rate] = carry.prior_kv, carry.prior_gate
        return slots_kv, slots_gate, kv[-1, :, :dim].clone(), gate[-1, :, :dim].clone()
