"""Qwen4-Exp's per-layer embeddings (PLE): hashed n-gram embeddings (`layers.ngram_hash`,
rows read from disk-backed tables, `layers.ngram_table`) injected into every hyper-connection
stream of a linear-attention layer, before its mixer.

Per token: the n-gram embedding e (every head's row, concatenated) gives one key per stream
`norm_key(key_proj(e))` and a value `value_proj(e)`; each stream's gate is the signed square
root of its normalised activations' dot with its key over sqrt(hidden); the gated values
`sigmoid(gate) * value` pass a dilated depthwise convolution (kernel `ple_conv_kernel_size`,
dilation `ngram_size`) of their normalised form, and the output is values plus silu(conv).

A request's state (a slot of the recurrent layers' pools, `state_cache`) is the
convolution's history, (kernel - 1) * dilation inputs, and the last `ngram_size - 1` tokens
(as id + 1, which float32 holds exactly: a zeroed slot is a fresh sequence's end-of-sequence
context), so chunked prefill, decode, verify rows and prefix snapshots continue a sequence
exactly. Replicated on every rank: the table lookups read the same rows on every node's page
cache, and the projections are small beside the layer's experts.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
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
from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.layers.mla import RowSliceLinear
from dgpp.engine.layers.ngram_hash import NgramHashing
from dgpp.engine.layers.ngram_table import NgramTable
from dgpp.engine.layers.norm import ZeroCentredRMSNorm
from dgpp.kernels.causal_conv1d_torch import causal_conv1d

TABLE_ROW_MULTIPLE = 128  # transformers pads each table's rows to a multiple of this


@dataclass(frozen=True)
class PleStateSpec:
    """One PLE layer's per-request state: `history` convolution inputs over `channels`, then
    `context` token ids."""

    channels: int
    history: int
    context: int

    @property
    def slot_numel(self) -> int:
        return self.history * self.channels + self.context

    def bytes_per_slot(self) -> int:
        return self.slot_numel * STATE_DTYPE.itemsize

    def allocate(self, num_layers: int, num_slots: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(num_layers, num_slots, self.slot_numel, dtype=STATE_DTYPE, device=device)

    def views(self, pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's pool [slots, slot_numel] as conv history [slots, history, channels] and
        token context [slots, context] (views)."""
        slots, split = pool.shape[0], self.history * self.channels
        return pool[:, :split].view(slots, self.history, self.channels), pool[:, split:]


@dataclass(frozen=True)
class PleDims:
    hidden: int
    streams: int
    embed_dim: int
    kernel: int
    dilation: int

    @property
    def channels(self) -> int:
        return self.hidden * self.streams

    @classmethod
    def of(cls, config: ModelConfig) -> PleDims:
        raw = config.raw
        return cls(
            hidden=config.hidden_size,
            streams=int(raw.get("hc_count", 4)),
            embed_dim=int(raw.get("ple_embed_dim") or config.hidden_size),
            kernel=int(raw.get("ple_conv_kernel_size", 4)),
            dilation=int(raw.get("ngram_size", 3)),
        )

    def state_spec(self) -> PleStateSpec:
        history = (self.kernel - 1) * self.dilation
        return PleStateSpec(self.channels, history, self.dilation - 1)


def ple_table_bytes(config: ModelConfig, dtype_bytes: int) -> int:
    """The bytes of every PLE layer's n-gram table (rows padded as transformers pads them)."""
    raw = config.raw
    dims = PleDims.of(config)
    total = 0
    for index in range(len(raw.get("ple_layer_ids") or ())):
        hashing = NgramHashing.of(raw, index)
        rows = -(-hashing.num_rows // TABLE_ROW_MULTIPLE) * TABLE_ROW_MULTIPLE
        total += rows * (dims.embed_dim // hashing.num_heads) * dtype_bytes
    return total


@dataclass(frozen=True)
class _Segment:
    """Rows of a step read and written together: tokens [rows, length] (index into the
    step's tokens), the slots their state is read from and written to, and whether they
    continue a sequence (else they start from zeros and end-of-sequence tokens)."""

    index: torch.Tensor | slice
    reads: torch.Tensor
    writes: torch.Tensor
    length: int
    continues: bool


def _segments(rows: StateRows, device: torch.device) -> Iterator[_Segment]:
    if rows.decode_slots is not None:
        count = rows.decode_slots.shape[0]
        yield _Segment(slice(0, count), rows.decode_slots, rows.decode_slots, 1, True)
    for position in rows.verify:
        yield _Segment(position.tokens, position.reads, position.writes, 1, True)
    for first, end, slot, continues in rows.prefills:
        held = torch.tensor([slot], dtype=torch.int64, device=device)
        yield _Segment(slice(first, end), held, held, end - first, continues)


class PerLayerEmbedding(StateSlotLayer):
    """One PLE layer: a state layer (`state_cache.StateLayer`) of the recurrent pools."""

    def __init__(
        self, config: ModelConfig, ple_index: int, backend: LinearStateBackend, table_name: str
    ) -> None:
        super().__init__()
        dims = PleDims.of(config)
        self.dims, self.table_name = dims, table_name
        self.hashing = NgramHashing.of(config.raw, ple_index)
        eps, channels = config.rms_norm_eps, dims.channels
        self.key_proj = RowSliceLinear(dims.embed_dim, (0, channels), bias=False)
        self.value_proj = RowSliceLinear(dims.embed_dim, (0, dims.hidden), bias=False)
        self.norm_key = ZeroCentredRMSNorm(channels, eps, dims.hidden)
        self.norm_query = ZeroCentredRMSNorm(channels, eps, dims.hidden)
        self.norm_conv = ZeroCentredRMSNorm(channels, eps, dims.hidden)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(  # type: ignore[assignment]
            torch.empty(channels, 1, dims.kernel), requires_grad=False
        )
        self.init_state(dims.state_spec(), backend)
        self.table: NgramTable | None = None  # attached after load (`attach_tables`)

    def forward(
        self, hidden: torch.Tensor, input_ids: torch.Tensor, metadata: StepMetadata
    ) -> torch.Tensor:
        """hidden [T, streams * H] (the residual streams), input_ids [T] -> what the layer
        adds to the streams [T, streams * H]."""
        assert self.state is not None and self.table is not None, "bound and attached first"
        rows: StateRows = metadata[self._backend.name]
        segments = list(_segments(rows, hidden.device))
        row_ids = self._table_rows(input_ids, segments)  # [T, heads]
        embedded = self.table.rows(row_ids).flatten(1).to(hidden.device, hidden.dtype)
        dims, tokens = self.dims, hidden.shape[0]
        key = self.norm_key(self.key_proj(embedded)).view(tokens, dims.streams, dims.hidden)
        value = self.value_proj(embedded)  # [T, H]
        query = self.norm_query(hidden).view(tokens, dims.streams, dims.hidden)
        gate = (key * query).sum(dim=-1, keepdim=True) / math.sqrt(dims.hidden)
        gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
        gated = (torch.sigmoid(gate) * value.unsqueeze(1)).flatten(1)  # [T, streams * H]
        return gated + self._short_conv(self.norm_conv(gated), segments)

    def _table_rows(self, input_ids: torch.Tensor, segments: list[_Segment]) -> torch.Tensor:
        """Each token's table rows [T, heads], its n-gram context read from (and the new one
        written to) the state."""
        assert self.state is not None
        _, context_pool = self.spec.views(self.state)
        width = self.spec.context
        out = input_ids.new_empty(input_ids.shape[0], self.hashing.num_heads)
        eos = self.hashing.eos_token_id
        for seg in segments:
            new = input_ids[seg.index].view(-1, seg.length)
            if seg.continues:  # kept as id + 1: a zeroed (fresh) slot reads as end-of-sequence
                kept = context_pool[seg.reads].to(torch.int64) - 1
                context = torch.where(kept < 0, eos, kept)
            else:
                context = torch.full((1, width), eos, dtype=torch.int64, device=new.device)
            history = torch.cat((context, new), dim=1)
            out[seg.index] = self.hashing.ids(history)[:, width:].reshape(-1, out.shape[1])
            context_pool[seg.writes] = (history[:, -width:] + 1).to(STATE_DTYPE)
        return out

    def _short_conv(self, x: torch.Tensor, segments: list[_Segment]) -> torch.Tensor:
        """silu of the dilated depthwise convolution of x [T, C], continuing each row's
        history: the dilated kernel is a plain one with zeros between its taps."""
        assert self.state is not None
        conv_pool, _ = self.spec.views(self.state)
        dims = self.dims
        taps = self.conv1d.weight[:, 0]  # [C, K]
        weight = taps.new_zeros(taps.shape[0], (dims.kernel - 1) * dims.dilation + 1)
        weight[:, :: dims.dilation] = taps
        out = torch.empty_like(x)
        for seg in segments:
            rows = x[seg.index].view(-1, seg.length, x.shape[1])
            state = conv_pool[seg.reads] if seg.continues else None
            y, new_state = causal_conv1d(rows, weight, None, state, "silu")
            conv_pool[seg.writes] = new_state.to(STATE_DTYPE)
            out[seg.index] = y.reshape(-1, x.shape[1])
        return out
