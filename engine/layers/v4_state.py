"""A DeepSeek-V4 attention layer's per-request state: its last `window - 1` keys (keys are
values) and, in a compressing layer, each compressor's carry (`window_compressor.
CompressorCarry`): the raw projections of the tokens since the last closed window and, where
windows overlap, the last closed window's first half.

It is a state slot (`dgpp.engine.backends.state_cache`) as Gated DeltaNet's is, so prefix-cache
snapshots, preemption and speculative verify rows (one state per position, rolled back by slot
copies) come from the same machinery. How much of it is real follows from the request's position
alone (positions run from 0): `min(start, window - 1)` keys, `start % rate` pending tokens, a first
half once `start >= rate`. Float32 whatever the model's dtype (the projections it holds are
exact in it); at a quantized `engine.kv_cache_dtype` the window's keys are stored as the
compressed keys are (`kernels.latent_quant` rows, the trailing rope dims kept, here at float32:
`layers.state_rows`), and the carries, projections not yet keys, stay float32.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from dgpp.engine.backends.state_cache import STATE_DTYPE
from dgpp.engine.layers import state_rows
from dgpp.engine.layers.window_compressor import CompressorCarry
from dgpp.kernels.latent_quant import RowFormat, row_format


@dataclass(frozen=True)
class CarrySpec:
    """One compressor's carry: fewer than `rate` pending projections (kv and gate) of
    `width`, and (overlapping windows) the last window's first half, `prior` wide."""

    rate: int
    width: int
    prior: int = 0

    @property
    def numel(self) -> int:
        return 2 * (self.rate - 1) * self.width + 2 * self.rate * self.prior


@dataclass(frozen=True)
class V4StateSpec:
    """The window's keys [history, dim] (their last `rope` dims rotated), then each carry (the
    layer's compressor, then its indexer's)."""

    dim: int
    history: int
    carries: tuple[CarrySpec, ...] = ()
    rope: int = 0
    kv_dtype: str = "auto"

    @property
    def key_format(self) -> RowFormat | None:
        return row_format(self.kv_dtype, self.dim - self.rope, self.rope)

    @property
    def window_numel(self) -> int:
        size = state_rows.row_bytes(self.key_format, self.dim)
        return state_rows.region_numel(self.history * size)

    @property
    def slot_numel(self) -> int:
        return self.window_numel + sum(carry.numel for carry in self.carries)

    def bytes_per_slot(self) -> int:
        return self.slot_numel * STATE_DTYPE.itemsize

    def allocate(self, num_layers: int, num_slots: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(num_layers, num_slots, self.slot_numel, dtype=STATE_DTYPE, device=device)

    def window(self, pool: torch.Tensor) -> torch.Tensor:
        """The keys [slots, history, dim] of one layer's pool [slots, slot_numel] as stored
        (float32, or `key_format`'s rows; a view)."""
        return state_rows.region(pool, 0, (self.history,), self.key_format, self.dim)

    def _carry_views(self, pool: torch.Tensor, index: int) -> list[torch.Tensor]:
        """Carry `index`'s pending kv, pending gate, prior kv and prior gate (views)."""
        spec, slots = self.carries[index], pool.shape[0]
        at = self.window_numel + sum(carry.numel for carry in self.carries[:index])
        views = []
        for rows, width in ((spec.rate - 1, spec.width),) * 2 + ((spec.rate, spec.prior),) * 2:
            views.append(pool[:, at : at + rows * width].view(slots, rows, width))
            at += rows * width
        return views

    def read_carry(
        self, pool: torch.Tensor, index: int, slot: int, start: int, dtype: torch.dtype
    ) -> CompressorCarry:
        """Carry `index` of `slot` after `start` tokens; projections in `dtype`."""
        spec = self.carries[index]
        kv, gate, prior_kv, prior_gate = self._carry_views(pool, index)
        pending, windows = start % spec.rate, start // spec.rate
        pending_kv, pending_gate = kv[slot, :pending].to(dtype), gate[slot, :pending].to(dtype)
        carry = CompressorCarry(pending_kv, pending_gate, windows=windows)
        if spec.prior and windows:
            return replace(carry, prior_kv=prior_kv[slot].to(dtype), prior_gate=prior_gate[slot])
        return carry

    def write_carry(
        self, pool: torch.Tensor, index: int, slot: int, carry: CompressorCarry
    ) -> None:
        kv, gate, prior_kv, prior_gate = self._carry_views(pool, index)
        pending = carry.pending_kv.shape[0]
        kv[slot, :pending] = carry.pending_kv
        gate[slot, :pending] = carry.pending_gate
        if carry.prior_kv is not None and carry.prior_gate is not None:
            prior_kv[slot] = carry.prior_kv
            prior_gate[slot] = carry.prior_gate
