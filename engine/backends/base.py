"""The interface between the model runner and the attention backends."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass(frozen=True)
class BatchRow:
    """One row of a step: `num_tokens` queries at positions `start ..`, whose keys and values
    (the new ones included) live in the blocks of `block_table`."""

    start: int
    num_tokens: int
    block_table: Sequence[int]
    state_slot: int = -1  # the request's slot in the recurrent layers' state pools (if any)

    @property
    def seq_len(self) -> int:
        return self.start + self.num_tokens


@dataclass(frozen=True)
class BatchLayout:
    """The step as a backend sees it, built by every rank from the step message: decode rows
    first (one query each, or a verify row's few), then prefill chunks."""

    rows: tuple[BatchRow, ...]
    num_decodes: int
    block_size: int
    prefill_softmax_fp32: bool  # prefill attention in float32 whatever the model dtype


# Each backend's metadata for one step, by backend name; a layer reads its own backend's entry.
StepMetadata = Mapping[str, Any]


class AttentionBackend(Protocol):
    """What the model runner needs of a backend: a name and the step's metadata."""

    name: str

    def prepare(self, layout: BatchLayout) -> Any:
        """This step's metadata, on the backend's device; built once per step, read by every
        layer that uses the backend."""
        ...


class PagedAttentionBackend(AttentionBackend, Protocol):
    """Attention over a paged KV cache [2, blocks, block_size, H_kv, D] per layer."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cache: torch.Tensor,
        metadata: Any,
        scale: float,
        sinks: torch.Tensor | None = None,
        sliding_window: int | None = None,
        angles: tuple[torch.Tensor, torch.Tensor] | None = None,
        kv_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Store key/value [T, H_kv, D] at the step's slots, then attend with query [T, H, D];
        returns [T, H, D]. `sinks` [H]: a logit per head in every softmax's denominator;
        `sliding_window`: a query at position p sees keys p - window < k <= p only; `angles`
        (cos, signed sin) [T, 1, D]: rotate query and key first (in the store, one pass);
        `kv_scales` [2]: the checkpoint's static key and value scales, for an fp8 cache."""
        ...
