"""The per-step inputs of the batched decode path: which cache slots each decode row reads, the
mask over them, and where verify rows' queries and outputs sit.

A sliding-window layer reads fewer slots than a full-attention one, so its inputs differ; they
depend on the step and the window alone, so `DecodeWindows` builds them once per step for each
window a layer asks for and every other layer of that window reuses them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# (slots [B, S], mask [B, 1, Q_max, S] or None): what `decode_gather_inputs` returns
DecodeContext = tuple[torch.Tensor, torch.Tensor | None]


def decode_gather_inputs(
    block_tables: Sequence[Sequence[int]],
    seq_lens: Sequence[int],
    block_size: int,
    device: torch.device,
    query_lens: Sequence[int] | None = None,
    window: int | None = None,
) -> DecodeContext:
    """Per-step inputs of the decode path: the cache slot of every context token a decode row
    reads [B, S_max] (padding points at slot 0) and the attention mask [B, 1, Q_max, S_max],
    None when every row has one query and reads equally many tokens. With `query_lens` (verify
    rows: the last `query_lens[b]` of row b's `seq_lens[b]` tokens are queries), query q of row
    b sees the tokens before it and itself; padded queries repeat the row's last one.

    With `window`, a query at position p sees only keys k with p - window < k <= p (the
    transformers rule), and row b reads only the slots of positions some query of it can see:
    from max(0, first query - window + 1) on. The slots before are never gathered."""
    counts = list(query_lens) if query_lens is not None else [1] * len(seq_lens)
    starts = [
        0 if window is None else max(0, seq_len - count - window + 1)
        for seq_len, count in zip(seq_lens, counts, strict=True)
    ]
    lengths = torch.tensor(seq_lens)  # [B]
    first = torch.tensor(starts)  # [B] first position each row reads
    num_read = lengths - first  # [B]
    width = int(num_read.max())
    steps = torch.arange(width)
    positions = first.unsqueeze(1) + steps  # [B, S]
    valid = steps.unsqueeze(0) < num_read.unsqueeze(1)  # [B, S]
    # Each row's blocks from the one holding its first read position, padded with block 0.
    first_blocks = [start // block_size for start in starts]
    num_blocks = max(-(-(start % block_size + width) // block_size) for start in starts)
    tables = torch.tensor(
        [
            _padded(table[lead : lead + num_blocks], num_blocks)
            for table, lead in zip(block_tables, first_blocks, strict=True)
        ]
    )  # [B, blocks]
    read = positions.masked_fill(~valid, 0)
    block_index = read // block_size - torch.tensor(first_blocks).unsqueeze(1)
    block_index = block_index.masked_fill(~valid, 0)
    slots = tables.gather(1, block_index) * block_size + read % block_size
    slots = slots.masked_fill(~valid, 0)
    if max(counts) == 1:
        # One query per row, at its last position: every slot read is visible to it.
        mask = None if int(num_read.min()) == width else valid[:, None, None, :].to(device)
        return slots.to(device), mask
    queries = torch.tensor(counts)  # [B]
    query_steps = torch.arange(max(counts)).unsqueeze(0)  # [1, Q]
    # Row b's query q sits at position seq_len - query_len + min(q, query_len - 1).
    last = (lengths - queries).unsqueeze(1) + torch.minimum(query_steps, (queries - 1).unsqueeze(1))
    query_pos = last.unsqueeze(2)  # [B, Q, 1]
    key_pos = positions.unsqueeze(1)  # [B, 1, S]
    mask = key_pos <= query_pos  # [B, Q, S]; padding sits past the last query, so it is masked
    if window is not None:
        mask &= query_pos - key_pos < window
    return slots.to(device), mask.unsqueeze(1).to(device)


def _padded(blocks: Sequence[int], width: int) -> list[int]:
    return [*blocks, *[0] * (width - len(blocks))]


def decode_query_index(
    query_lens: Sequence[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """For decode rows with several queries: where each padded query [B, Q_max] comes from in
    the step's decode queries, and where each decode query's output sits in the padded [B *
    Q_max] outputs. None when every row has exactly one query."""
    width = max(query_lens)
    if width == 1:
        return None
    gather: list[list[int]] = []
    scatter: list[int] = []
    start = 0
    for row, count in enumerate(query_lens):
        gather.append([start + min(q, count - 1) for q in range(width)])
        scatter.extend(row * width + q for q in range(count))
        start += count
    return (
        torch.tensor(gather, dtype=torch.int64, device=device),
        torch.tensor(scatter, dtype=torch.int64, device=device),
    )


class DecodeWindows:
    """The decode rows' `DecodeContext` per sliding window, for one step: built when the first
    layer of that window asks, then shared by the step's other layers of the same window.

    Holds the host-side decode rows the inputs are built from; what `context` returns for a
    window never changes within the step, so the metadata holding this stays a value to the
    layers."""

    def __init__(
        self,
        block_tables: Sequence[Sequence[int]],
        seq_lens: Sequence[int],
        query_lens: Sequence[int],
        block_size: int,
        device: torch.device,
    ) -> None:
        self._block_tables = block_tables
        self._seq_lens = seq_lens
        self._query_lens = query_lens
        self._block_size = block_size
        self._device = device
        self._built: dict[int, DecodeContext] = {}

    def context(self, window: int) -> DecodeContext:
        found = self._built.get(window)
        if found is None:
            found = decode_gather_inputs(
                self._block_tables,
                self._seq_lens,
                self._block_size,
                self._device,
                self._query_lens,
                window,
            )
            self._built[window] = found
        return found
