"""Sliding-window attention whose keys and values are a per-request state, not paged.

A layer whose queries see only the last `window` keys (their own included) needs no more than the
`window - 1` keys and values before a request's next token: keeping every position's in the
paged pool, as a full layer does, holds the whole context for a window of 128. Here each request
has a state slot (`dgpp.engine.backends.state_cache`, as a recurrent layer's) holding those last
keys and values, newest last, and how many of them are real (fewer at a sequence's start). A step
attends over the slot's keys and its own, then keeps the last `window - 1` of them. The slot is what
a prefix-cache snapshot saves and a hit restores, and speculative verify rows keep one state per
position in the draft slots, all as for Gated DeltaNet. What it costs: `window - 1` keys and
values per request and snapshot (float32, or each head in `engine.kv_cache_dtype`'s bytes, as a
paged layer's: `state_rows`), instead of the layer's share of every cached token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dgpp.engine.backends.base import StepMetadata
from dgpp.engine.backends.state_cache import (
    STATE_DTYPE,
    LinearStateBackend,
    StateRows,
    StateSlotLayer,
)
from dgpp.engine.layers import state_rows
from dgpp.engine.layers.attention import PagedAttention
from dgpp.kernels.kv_quant import kv_format

QUERY_BLOCK = 256  # prefill queries attended at a time (bounds the scores' memory)


@dataclass(frozen=True)
class WindowStateSpec:
    """One windowed layer's state on one rank: a count, then `history` tokens' keys
    [num_kv_heads, head_dim] and values [num_kv_heads, v_head_dim], float32 or per head at
    `kv_dtype` (`state_rows`)."""

    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    history: int
    kv_dtype: str = "auto"

    @property
    def formats(self) -> tuple[state_rows.RowCodec, state_rows.RowCodec]:
        """The keys' and the values' per-head formats (None: float32)."""
        return kv_format(self.kv_dtype, self.head_dim), kv_format(self.kv_dtype, self.v_head_dim)

    def _numel(self, fmt: state_rows.RowCodec, width: int) -> int:
        size = state_rows.row_bytes(fmt, width)
        return state_rows.region_numel(self.history * self.num_kv_heads * size)

    @property
    def key_numel(self) -> int:
        return self._numel(self.formats[0], self.head_dim)

    @property
    def slot_numel(self) -> int:
        return 1 + self.key_numel + self._numel(self.formats[1], self.v_head_dim)

    def bytes_per_slot(self) -> int:
        return self.slot_numel * STATE_DTYPE.itemsize

    def allocate(self, num_layers: int, num_slots: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(num_layers, num_slots, self.slot_numel, dtype=STATE_DTYPE, device=device)

    def views(self, pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One layer's pool [slots, slot_numel] as counts [slots], keys [slots, history, H_kv,
        D] and values [slots, history, H_kv, Dv] as stored (float32, or each head's bytes at a
        quantized `kv_dtype`; views: writes land in the pool)."""
        shape, (keys, values) = (self.history, self.num_kv_heads), self.formats
        key_rows = state_rows.region(pool, 1, shape, keys, self.head_dim)
        at = 1 + self.key_numel
        return pool[:, 0], key_rows, state_rows.region(pool, at, shape, values, self.v_head_dim)


def window_attend(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """query [R, n, H, D] over keys [R, m, H_kv, D] and values [R, m, H_kv, Dv] where `visible`
    [R, n, m] allows, in float32, each query head reading key head h // (H / H_kv) (as
    transformers' `repeat_kv`); a sink logit per head joins each softmax. Returns [R, n, H, Dv]."""
    rows, n, heads, dim = query.shape
    kv_heads = keys.shape[2]
    group = heads // kv_heads
    q = query.float().view(rows, n, kv_heads, group, dim)
    scores = torch.einsum("rnkgd,rmkd->rkgnm", q, keys.float()) * scale
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, kv_heads, group, 1, 1).expand(rows, -1, -1, n, 1)
        scores = torch.cat((scores, sink), dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., : keys.shape[1]]
    out = torch.einsum("rkgnm,rmkv->rnkgv", probs, values.float())
    return out.reshape(rows, n, heads, values.shape[-1])


class WindowAttention(StateSlotLayer):
    """A state layer (`dgpp.engine.backends.state_cache.StateLayer`) in a paged attention's place:
    query [T, H, D], key [T, H_kv, D] and value [T, H_kv, Dv] in (rotated, the keys), the
    output [T, H, Dv] out. `has_sinks` as `PagedAttention`'s, loaded the same way."""

    sinks: nn.Parameter | None
    load_sinks = PagedAttention.load_sinks

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        v_head_dim: int,
        scale: float,
        window: int,
        backend: LinearStateBackend,
        *,
        has_sinks: bool = False,
        first_head: int = 0,
    ) -> None:
        super().__init__()
        if window < 2:
            raise ValueError(f"a window of {window} keys keeps no history; use at least 2")
        self.num_heads, self.scale, self.first_head = num_heads, scale, first_head
        spec = WindowStateSpec(num_kv_heads, head_dim, v_head_dim, window - 1, backend.kv_dtype)
        self.init_state(spec, backend)
        sinks = nn.Parameter(torch.empty(num_heads), requires_grad=False) if has_sinks else None
        self.register_parameter("sinks", sinks)
        if sinks is not None:
            sinks.weight_loader = self.load_sinks  # type: ignore[attr-defined]

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, metadata: StepMetadata
    ) -> torch.Tensor:
        rows: StateRows = metadata[self._backend.name]
        out = query.new_empty(query.shape[0], self.num_heads, value.shape[-1])
        if rows.decode_slots is not None:
            count = rows.decode_slots.shape[0]
            slots = rows.decode_slots
            out[:count] = self._step(slots, slots, query[:count], key[:count], value[:count])
        for position in rows.verify:  # verify rows: one position at a time, each state kept
            at = position.tokens
            out[at] = self._step(position.reads, position.writes, query[at], key[at], value[at])
        for (first, end, slot, continues), start in zip(
            rows.prefills, rows.prefill_starts, strict=True
        ):
            held = min(start, self.spec.history) if continues else 0
            span = slice(first, end)
            out[span] = self._chunk(slot, held, query[span], key[span], value[span])
        return out

    def _step(
        self,
        reads: torch.Tensor,
        writes: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
    ) -> torch.Tensor:
        """One token per row, its state read from slot `reads[i]` and the state after it
        written to `writes[i]`; no host synchronisation (decode graphs capture it)."""
        assert self.state is not None, "the model runner binds every state before a forward"
        counts, key_pool, value_pool = self.spec.views(self.state)
        history, (key_format, value_format) = self.spec.history, self.spec.formats
        # As stored: [n, W, H_kv, D] float32, or each head's bytes
        keys = torch.cat((key_pool[reads], state_rows.encode(key[:, None], key_format)), dim=1)
        values = torch.cat((value_pool[reads], state_rows.encode(value[:, None], value_format)), 1)
        held = counts[reads]
        index = torch.arange(history + 1, device=query.device)
        visible = (index[None] >= history - held[:, None]).view(-1, 1, history + 1)
        out = window_attend(
            query[:, None],
            state_rows.decode(keys, key_format),
            state_rows.decode(values, value_format),
            visible,
            self.scale,
            self.sinks,
        )
        key_pool[writes] = keys[:, 1:]
        value_pool[writes] = values[:, 1:]
        counts[writes] = torch.clamp(held + 1, max=history)
        return out[:, 0].to(query.dtype)

    def _chunk(
        self, slot: int, held: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> torch.Tensor:
        """A prefill chunk after `held` tokens of the slot's history, its queries in blocks of
        `QUERY_BLOCK`, each over the keys its window reaches: the scores stay [H, block,
        block + window] however long the chunk."""
        assert self.state is not None, "the model runner binds every state before a forward"
        counts, key_pool, value_pool = self.spec.views(self.state)
        history, n, (key_format, value_format) = (
            self.spec.history,
            query.shape[0],
            self.spec.formats,
        )
        stored_keys = torch.cat(
            (key_pool[slot, history - held :], state_rows.encode(key, key_format))
        )
        stored_values = torch.cat(
            (value_pool[slot, history - held :], state_rows.encode(value, value_format))
        )
        keys = state_rows.decode(stored_keys, key_format)  # [held + n, H_kv, D] float32
        values = state_rows.decode(stored_values, value_format)
        out = query.new_empty(n, self.num_heads, value.shape[-1])
        for low in range(0, n, QUERY_BLOCK):
            high = min(n, low + QUERY_BLOCK)
            first = max(0, held + low - history)  # the first key the block's first query sees
            at = torch.arange(low, high, device=query.device)[:, None] + held  # query's own key
            index = torch.arange(first, held + high, device=query.device)[None]
            visible = (index <= at) & (index > at - history - 1)
            span = slice(first, held + high)
            attended = window_attend(
                query[None, low:high],
                keys[None, span],
                values[None, span],
                visible[None],
                self.scale,
                self.sinks,
            )
            out[low:high] = attended[0].to(query.dtype)
        kept = min(history, held + n)
        key_pool[slot, history - kept :] = stored_keys[held + n - kept :]
        value_pool[slot, history - kept :] = stored_values[held + n - kept :]
        counts[slot] = kept
        return out
