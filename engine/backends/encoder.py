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


# Query-key pairs (per head) one padded attention call may score: the scores are materialized
# where a mask is needed (CPU), B x H x L^2 floats. A prompt longer than its square root is
# attended alone, unpadded and unmasked, where SDPA's flash kernels keep memory linear.
PAIRS = 1 << 22


@dataclass(frozen=True)
class EncoderGroup:
    """Tokens `begin .. end` of the step: consecutive prompts attended in one padded call (token
    t of the group is row `rows[t]`, position `columns[t]`; `lengths` [b]), or one long prompt
    alone (`rows` None)."""

    begin: int
    end: int
    rows: torch.Tensor | None
    columns: torch.Tensor | None
    lengths: torch.Tensor | None
    longest: int
    ragged: bool  # lengths differ: padding is masked


@dataclass(frozen=True)
class EncoderRows:
    """A step's prompts: token t of the step belongs to prompt `rows[t]`; `lengths` [B] each
    prompt's tokens; `groups` how attention takes them."""

    rows: torch.Tensor  # [T] long
    lengths: torch.Tensor  # [B] long
    groups: tuple[EncoderGroup, ...]

    @property
    def starts(self) -> torch.Tensor:
        """Each prompt's first token's index in the step [B]."""
        return torch.cumsum(self.lengths, 0) - self.lengths

    @property
    def ends(self) -> torch.Tensor:
        """Each prompt's last token's index in the step [B]."""
        return torch.cumsum(self.lengths, 0) - 1


def _groups(lengths: list[int], device: torch.device) -> tuple[EncoderGroup, ...]:
    """Consecutive prompts in padded calls of at most `PAIRS` query-key pairs a head; a prompt
    past that alone."""
    found = []
    index = token = 0
    while index < len(lengths):
        size = lengths[index]
        if size * size > PAIRS:
            found.append(EncoderGroup(token, token + size, None, None, None, size, False))
            index, token = index + 1, token + size
            continue
        stop, longest = index, 0
        while stop < len(lengths) and lengths[stop] ** 2 <= PAIRS:
            widest = max(longest, lengths[stop])
            if (stop - index + 1) * widest * widest > PAIRS:
                break
            longest, stop = widest, stop + 1
        sizes = lengths[index:stop]
        count = torch.tensor(sizes, dtype=torch.long)
        rows = torch.repeat_interleave(torch.arange(len(sizes)), count)
        columns = torch.cat([torch.arange(n) for n in sizes])
        found.append(
            EncoderGroup(
                token,
                token + sum(sizes),
                rows.to(device),
                columns.to(device),
                count.to(device),
                longest,
                len(set(sizes)) > 1,
            )
        )
        index, token = stop, token + sum(sizes)
    return tuple(found)


class EncoderAttentionBackend:
    """Bidirectional attention within each prompt of the step: consecutive prompts in one padded
    SDPA call, a long one alone (`PAIRS`)."""

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
        device = self.device
        return EncoderRows(rows.to(device), sizes.to(device), _groups(lengths, device))

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rows: EncoderRows,
        scale: float,
    ) -> torch.Tensor:  # fmt: skip
        """query/key/value [T, H, D] -> [T, H, D], each token over its own prompt's tokens."""
        out = torch.empty_like(query)
        for group in rows.groups:
            part = slice(group.begin, group.end)
            q, k, v = query[part], key[part], value[part]
            if group.rows is None or group.columns is None or group.lengths is None:
                heads_first = [x.transpose(0, 1) for x in (q, k, v)]  # [H, L, D]
                out[part] = F.scaled_dot_product_attention(*heads_first, scale=scale).transpose(
                    0, 1
                )
                continue
            batch, heads, dim = group.lengths.shape[0], q.shape[1], q.shape[2]
            padded = []
            for x in (q, k, v):
                grid = x.new_zeros(batch, group.longest, heads, dim)
                grid[group.rows, group.columns] = x
                padded.append(grid.transpose(1, 2))  # [b, H, L, D]
            mask = None
            if group.ragged:
                positions = torch.arange(group.longest, device=q.device)
                mask = (positions[None, :] < group.lengths[:, None])[:, None, None, :]
            attended = F.scaled_dot_product_attention(*padded, attn_mask=mask, scale=scale)
            out[part] = attended.transpose(1, 2)[group.rows, group.columns]
        return out
