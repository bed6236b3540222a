"""Fixed-size per-request state for recurrent layers (Gated DeltaNet), beside the paged KV.

A recurrent layer's cache is not paged by tokens: each request has one *state slot*, the layer's
short-convolution history and its recurrent state after the request's last computed token. Every
layer with the same `LinearStateSpec` shares one float32 pool [layers, slots, slot_numel]; a slot
index names the same request in every layer's pool. Slots come in two kinds, both in the same
pools: `num_running` slots for the requests being served, then snapshot slots that keep the
state of a cached prefix (`dgpp.engine.cache.state_snapshots`), copied into a request's slot on a
hit, and with speculative decoding `draft_depth` *draft slots* per running slot.

A verify row (the last known token and d draft tokens) runs the recurrence one position at a
time, each position reading the state the one before wrote: the state after position j < d
goes to the request's draft slot j, the state after the last position to the slot itself, so
keeping every position's state moves no more bytes than the recurrence does anyway. When only a
of the d drafts are accepted, the state after position a is the right one: the next step copies
draft slot a into the slot before its forward (`StepMessage.restores`), so a rejected draft
leaves nothing behind (issue 37; docs/models.md weighs it against checkpoint-and-recompute).

Rank 0 assigns the slots; a step message carries each row's slot and the copies (restore a
snapshot before the forward, save one after), so every rank moves the same states.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from dgpp.engine.backends.base import BatchLayout, BatchRow

STATE_DTYPE = torch.float32  # recurrent state and conv history, whatever the weights' dtype


@dataclass(frozen=True)
class LinearStateSpec:
    """One Gated DeltaNet layer's state on one rank: the last `conv_width - 1` inputs of its
    depthwise convolution over `conv_dim` channels, and a [head_k_dim, head_v_dim] matrix per
    value head."""

    conv_dim: int
    conv_width: int
    num_heads: int
    head_k_dim: int
    head_v_dim: int

    @property
    def conv_numel(self) -> int:
        return (self.conv_width - 1) * self.conv_dim

    @property
    def recurrent_numel(self) -> int:
        return self.num_heads * self.head_k_dim * self.head_v_dim

    @property
    def slot_numel(self) -> int:
        return self.conv_numel + self.recurrent_numel

    def bytes_per_slot(self) -> int:
        return self.slot_numel * STATE_DTYPE.itemsize

    def allocate(self, num_layers: int, num_slots: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(num_layers, num_slots, self.slot_numel, dtype=STATE_DTYPE, device=device)

    def views(self, pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's pool [slots, slot_numel] as conv history [slots, W - 1, conv_dim] and
        recurrent state [slots, heads, K, V], both views (writes land in the pool)."""
        slots = pool.shape[0]
        conv = pool[:, : self.conv_numel].view(slots, self.conv_width - 1, self.conv_dim)
        recurrent = pool[:, self.conv_numel :].view(
            slots, self.num_heads, self.head_k_dim, self.head_v_dim
        )
        return conv, recurrent


@dataclass(frozen=True)
class StateRows:
    """What a recurrent layer reads of a step: the decode rows' slots (one token each, the
    first `len(decode_slots)` tokens), then per prefill chunk its token range, slot and
    whether it continues a state (False: it starts at position 0 from zeros)."""

    decode_slots: torch.Tensor | None  # [num_decodes] int64 on the device
    prefills: tuple[tuple[int, int, int, bool], ...]  # (first token, end token, slot, continues)
    verify: tuple[VerifyPosition, ...] = ()  # with verify rows: the decode rows by position
    prefill_starts: tuple[int, ...] = ()  # each prefill chunk's first position


@dataclass(frozen=True)
class VerifyPosition:
    """Position j of a step's decode rows when some verify several tokens: the token index of
    every decode row at least j + 1 tokens long, the slot its state is read from (its own at
    j = 0, else its draft slot j - 1) and the slot the state after j is written to (draft slot
    j, or its own slot at the row's last position)."""

    tokens: torch.Tensor  # [n] int64
    reads: torch.Tensor  # [n] int64
    writes: torch.Tensor  # [n] int64


class LinearStateBackend:
    """Builds `StateRows` once per step for every recurrent layer."""

    name = "linear-state"
    # a decode-only step reads its slots tensor only (`dgpp.engine.execution.decode_graphs`)
    graph_safe = True

    def __init__(self, device: torch.device, kv_dtype: str = "auto") -> None:
        """`kv_dtype`: what a sliding window's keys and values in a state are stored at
        (recurrent states keep their precision)."""
        self.device, self.kv_dtype = device, kv_dtype
        self.layout: StateLayout | None = None  # the runner's, for the draft slots

    def prepare(self, layout: BatchLayout) -> StateRows:
        decodes = layout.rows[: layout.num_decodes]
        assert all(row.state_slot >= 0 for row in layout.rows), "a row without a state slot"
        decode_slots = None
        verify: tuple[VerifyPosition, ...] = ()
        if any(row.num_tokens > 1 for row in decodes):
            verify = self._verify_positions(decodes)
        elif decodes:
            slots = [row.state_slot for row in decodes]
            decode_slots = torch.tensor(slots, dtype=torch.int64, device=self.device)
        prefills = []
        at = sum(row.num_tokens for row in decodes)
        chunks = layout.rows[layout.num_decodes :]
        for row in chunks:
            prefills.append((at, at + row.num_tokens, row.state_slot, row.start > 0))
            at += row.num_tokens
        return StateRows(decode_slots, tuple(prefills), verify, tuple(r.start for r in chunks))

    def _verify_positions(self, decodes: Sequence[BatchRow]) -> tuple[VerifyPosition, ...]:
        layout = self.layout
        longest = max(row.num_tokens for row in decodes)
        assert layout is not None and longest - 1 <= layout.draft_depth, "no draft slots"

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=self.device)

        positions = []
        for j in range(longest):
            at, reads, writes, first = [], [], [], 0
            for row in decodes:
                slot = row.state_slot
                if row.num_tokens > j:
                    at.append(first + j)
                    reads.append(layout.draft_slot(slot, j - 1) if j else slot)
                    last = row.num_tokens == j + 1
                    writes.append(slot if last else layout.draft_slot(slot, j))
                first += row.num_tokens
            positions.append(VerifyPosition(tensor(at), tensor(reads), tensor(writes)))
        return tuple(positions)


@runtime_checkable
class StateLayer(Protocol):
    """A module with a per-request state: the runner allocates by `state_spec` and binds each
    one's pool [slots, slot_numel]; `state_backend` prepares the rows it reads."""

    @property
    def state_spec(self) -> LinearStateSpec: ...

    @property
    def state_backend(self) -> LinearStateBackend: ...

    def bind_state(self, pool: torch.Tensor) -> None: ...


class StateSlotLayer(torch.nn.Module):
    """A `StateLayer` built on `self.spec`, `self._backend` and `self.state` (the bound pool),
    which its `__init__` sets (via `init_state`)."""

    def init_state(self, spec: Any, backend: LinearStateBackend) -> None:
        self.spec, self._backend = spec, backend
        self.state: torch.Tensor | None = None

    @property
    def state_spec(self) -> Any:
        return self.spec

    @property
    def state_backend(self) -> LinearStateBackend:
        return self._backend

    def bind_state(self, pool: torch.Tensor) -> None:
        self.state = pool


def state_layers(model: torch.nn.Module) -> list[StateLayer]:
    return [module for module in model.modules() if isinstance(module, StateLayer)]


def allocate_states(
    layers: Iterable[StateLayer], num_slots: int, device: torch.device
) -> list[torch.Tensor]:
    """One pool per distinct spec; each layer is bound to its share."""
    groups: dict[LinearStateSpec, list[StateLayer]] = {}
    for layer in layers:
        groups.setdefault(layer.state_spec, []).append(layer)
    pools = []
    for spec, members in groups.items():
        pool = spec.allocate(len(members), num_slots, device)
        for index, layer in enumerate(members):
            layer.bind_state(pool[index])
        pools.append(pool)
    return pools


def copy_slots(pools: Sequence[torch.Tensor], pairs: Sequence[tuple[int, int]]) -> None:
    """Copy slot `src` to slot `dst` in every layer of every pool, for each (src, dst)."""
    if not pairs:
        return
    for pool in pools:
        src = torch.tensor([p[0] for p in pairs], dtype=torch.int64, device=pool.device)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.int64, device=pool.device)
        pool[:, dst] = pool[:, src]


def zero_slots(pools: Sequence[torch.Tensor], slots: Sequence[int]) -> None:
    """Clear `slots` in every layer of every pool (a fresh sequence's state)."""
    if not slots:
        return
    for pool in pools:
        pool[:, torch.tensor(slots, dtype=torch.int64, device=pool.device)] = 0


@dataclass(frozen=True)
class StateLayout:
    """How many slots the pools have, and what one slot costs on this rank (every layer):
    running slots, then snapshot slots, then `draft_depth` draft slots per running slot."""

    slot_bytes: int  # one request's state in every recurrent layer of this rank
    num_running: int  # slots for requests being served (max_concurrency)
    num_snapshots: int  # slots for prefix-cache snapshots
    draft_depth: int = 0  # draft slots per running slot (speculative decoding's depth)

    @property
    def num_slots(self) -> int:
        return self.num_running * (1 + self.draft_depth) + self.num_snapshots

    @property
    def num_draft_slots(self) -> int:
        return self.num_running * self.draft_depth

    def draft_slot(self, slot: int, position: int) -> int:
        """Where running slot `slot` keeps its state after position `position` of a verify
        row (0: the last known token only)."""
        assert 0 <= slot < self.num_running and 0 <= position < self.draft_depth
        return self.num_running + self.num_snapshots + slot * self.draft_depth + position

    @property
    def total_bytes(self) -> int:
        return self.num_slots * self.slot_bytes


def state_layout(
    specs: Sequence[LinearStateSpec],
    max_concurrency: int,
    snapshot_bytes: int,
    max_snapshots: int,
    draft_depth: int = 0,
) -> StateLayout:
    """Slots for `max_concurrency` requests, plus as many snapshots as `snapshot_bytes` holds,
    at most `max_snapshots` (a snapshot needs a cached KV block to be found, so more than the KV
    pool has blocks are never useful), plus `draft_depth` draft slots per request (speculative
    decoding). No recurrent layers: no slots at all."""
    slot_bytes = sum(spec.bytes_per_slot() for spec in specs)
    if not slot_bytes:
        return StateLayout(0, 0, 0)
    snapshots = min(max_snapshots, math.floor(snapshot_bytes / slot_bytes))
    return StateLayout(slot_bytes, max_concurrency, max(0, snapshots), draft_depth)
