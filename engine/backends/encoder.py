"""Attention of an encoder-only model (BERT, XLM-RoBERTa): every token of a prompt sees every
other token of it, so a prompt is computed whole, in one step (the scheduler's whole-prompt
policy, `StepPolicy.whole_prompts`), and nothing is cached: a later token changes the earlier
ones' states, so there is no prefix to reuse and no decode step.

`NoCacheSpec` is the layers' cache: no bytes, so the memory plan counts none and the block
tables the scheduler keeps are bookkeeping only."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dgpp.engine.backends.base import BatchLayout


@dataclass(frozen=True)
class NoCacheSpec:
    """An encoder layer's cache: none."""

    block_axis = 0

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        del dtype
        return 0

    def allocate(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor:
        del num_blocks, block_size
        return torch.empty((num_layers, 0), dtype=dtype, device=device)


@dataclass(frozen=True)
class EncoderRows:
    """A step's prompts as rows of a padded batch: token t of the step is row `rows[t]`,
    position `columns[t]` of it; `lengths` [B] each prompt's tokens."""

    rows: torch.Tensor  # [T] long
    columns: torch.Tensor  # [T] long
    lengths: torch.Tensor  # [B] long
    longest: int

    @property
    def starts(self) -> torch.Tensor:
        """Each prompt's first token's index in the step [B]."""
        return torch.cumsum(self.lengths, 0) - self.lengths

    @property
    def ends(self) -> torch.Tensor:
        """Each prompt's last token's index in the step [B]."""
        return torch.cumsum(self.lengths, 0) - 1


class EncoderAttentionBackend:
    """Bidirectional attention within each prompt of the step, one padded SDPA call."""

    name = "encoder"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def prepare(self, layout: BatchLayout) -> EncoderRows:
        lengths = []
        for row in layout.rows:
            if row.start != 0:
                raise RuntimeError(
                    f"an encoder computes a prompt whole; this step has a row from token "
                    f"{row.start} (the scheduler must plan whole prompts)"
                )
            lengths.append(row.num_tokens)
        sizes = torch.tensor(lengths, dtype=torch.long)
        rows = torch.repeat_interleave(torch.arange(len(lengths)), sizes)
        columns = torch.cat([torch.arange(n) for n in lengths]) if lengths else rows
        device = self.device
        return EncoderRows(
            rows.to(device), columns.to(device), sizes.to(device), max(lengths, default=0)
        )

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rows: EncoderRows,
        scale: float,
    ) -> torch.Tensor:  # fmt: skip
        """query/key/value [T, H, D] -> [T, H, D], each token over its own prompt's tokens."""
        batch, heads, dim = rows.lengths.shape[0], query.shape[1], query.shape[2]
        padded = []
        for x in (query, key, value):
            out = x.new_zeros(batch, rows.longest, heads, dim)
            out[rows.rows, rows.columns] = x
            padded.append(out.transpose(1, 2))  # [B, H, L, D]
        positions = torch.arange(rows.longest, device=query.device)
        visible = (positions[None, :] < rows.lengths[:, None])[:, None, None, :]  # [B, 1, 1, L]
        out = F.scaled_dot_product_attention(*padded, attn_mask=visible, scale=scale)
        return out.transpose(1, 2)[rows.rows, rows.columns]
