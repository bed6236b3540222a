"""What Gated DeltaNet (`layers.gated_deltanet`) and Kimi Delta Attention (`layers.kimi_delta`)
share: a short causal convolution, then a delta rule, over a state slot per request
(`dgpp.engine.backends.state_cache`: the conv's last inputs and the recurrent state). A step's
decode rows run one token each from their slots, speculative verify rows one position at a time with
each position's state kept in the draft slots, prefill chunks through the chunk form from their
slot (or from zeros at a sequence's start)."""

from __future__ import annotations

import torch
from torch import nn

from dgpp.engine.backends.state_cache import StateRows, StateSlotLayer
from dgpp.engine.errors import ModelLoadError
from dgpp.kernels.causal_conv1d_torch import causal_conv1d
from dgpp.kernels.gated_delta import GatedDeltaFns


def head_param(first: int, count: int, width: int) -> nn.Parameter:
    """A per-head parameter (Gated DeltaNet's `A_log`, `dt_bias` [H]; KDA's `A_log`
    [1, 1, H, 1], `dt_bias` [H * width]) as this rank's heads `first .. first + count`, flat
    [count * width]; the checkpoint's tensor has one axis longer than 1."""
    param = nn.Parameter(torch.empty(count * width), requires_grad=False)

    def load(target: nn.Parameter, loaded: torch.Tensor) -> None:
        flat, end = loaded.reshape(-1), (first + count) * width
        if sum(size > 1 for size in loaded.shape) > 1 or flat.shape[0] < end:
            raise ModelLoadError(f"a per-head tensor of shape {tuple(loaded.shape)}")
        target.data.copy_(flat[first * width : end])

    param.weight_loader = load  # type: ignore[attr-defined]
    return param


class ConvDeltaLayer(StateSlotLayer):
    """A subclass holds `conv1d.weight` [conv_dim, W] and `_kernels` (its delta rule's), and
    says how the convolved channels split into q, k, v heads (`_heads`)."""

    _kernels: GatedDeltaFns | None

    def _heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def run_rows(
        self,
        rows: StateRows,
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """The delta rule's output of every token into out [T, heads, dv], from the conv's
        input `mixed` [T, conv_dim], the log decays `g` and the write strengths `beta`."""
        assert self.state is not None and self._kernels is not None, "bound and selected first"
        conv_pool, recurrent_pool = self.spec.views(self.state)
        weight = self.conv1d.weight  # type: ignore[union-attr]
        if rows.decode_slots is not None:
            count, slots = rows.decode_slots.shape[0], rows.decode_slots
            out[:count] = self._step(slots, slots, mixed[:count], g[:count], beta[:count])
        for position in rows.verify:  # verify rows: one position at a time, each state kept
            at = position.tokens
            out[at] = self._step(position.reads, position.writes, mixed[at], g[at], beta[at])
        for first, end, slot, continues in rows.prefills:
            held = slice(slot, slot + 1)
            previous = conv_pool[held] if continues else None
            x, new_conv = causal_conv1d(mixed[None, first:end], weight, None, previous, "silu")
            conv_pool[slot] = new_conv[0]
            o, state = self._kernels.chunk(
                *self._heads(x),
                g[None, first:end],
                beta[None, first:end],
                recurrent_pool[held] if continues else None,
                None,
                True,
            )
            recurrent_pool[slot] = state[0]
            out[first:end] = o[0]

    def _step(
        self,
        reads: torch.Tensor,
        writes: torch.Tensor,
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
    ) -> torch.Tensor:
        """One token for each row of mixed [n, conv_dim], its state read from slot `reads[i]`
        and the state after it written to `writes[i]` (the same slot for a plain decode row);
        the output [n, heads, dv]."""
        assert self.state is not None and self._kernels is not None
        conv_pool, recurrent_pool = self.spec.views(self.state)
        weight = self.conv1d.weight  # type: ignore[union-attr]
        x, new_conv = causal_conv1d(mixed[:, None], weight, None, conv_pool[reads], "silu")
        conv_pool[writes] = new_conv.to(conv_pool.dtype)
        o, state = self._kernels.recurrent(
            *self._heads(x), g[:, None], beta[:, None], recurrent_pool[reads], None, True
        )
        recurrent_pool[writes] = state.to(recurrent_pool.dtype)
        return o[:, 0]
