"""Inputs the paged-attention kernels share for one forward step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dgpp.kernels.decode_inputs import DecodeContext, DecodeWindows


@dataclass(frozen=True)
class PagedAttentionMetadata:
    """Describes a flattened batch of sequences for paged attention.

    Rows `[0, num_decodes)` are decode rows: one query token each, or a few for a speculative
    verify row (the last token and its draft); the rest are prefill chunks. Each sequence's
    queries are the *last* `query_len` positions of its `seq_len` tokens, whose keys and values
    (the new ones included) live in the blocks of its block table. Host-side lists mirror the
    tensors so CPU code never synchronises to read them.
    """

    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with 0
    query_start_loc: torch.Tensor  # [B + 1] int64
    seq_lens: torch.Tensor  # [B] int64
    query_start_loc_host: tuple[int, ...]
    seq_lens_host: tuple[int, ...]
    num_decodes: int
    max_seq_len: int
    prefill_softmax_fp32: bool  # compute prefill attention in float32 whatever the model dtype
    # Decode rows only, computed once per step rather than once per layer:
    decode_slots: torch.Tensor | None = None  # [B_dec, S_max] cache slot of every context token
    decode_mask: torch.Tensor | None = None  # [B_dec, 1, Q_max, S_max] bool; None: no padding
    # Verify rows only (some decode row has several queries), else None:
    decode_query_index: torch.Tensor | None = None  # [B_dec, Q_max] int64 into decode queries
    decode_output_index: torch.Tensor | None = None  # [T_dec] int64 into [B_dec * Q_max] outputs
    # Decode rows' slots and masks for sliding-window layers, built once per window per step:
    decode_windows: DecodeWindows | None = None
    # Each query token's row [T] and position [T] (int32 or int64), for kernels that walk every
    # token's own keys (the Triton backend builds them once per step); None: derive them.
    token_rows: torch.Tensor | None = None
    token_positions: torch.Tensor | None = None
    # The first token of each prefill tile (`paged_prefill_triton`), int32; None: derive them.
    prefill_tile_starts: torch.Tensor | None = None

    def rows_and_positions(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `num_tokens` query tokens' rows and positions: the ones built with the
        metadata (the Triton backend's), else `token_rows_and_positions`."""
        if self.token_rows is None or self.token_positions is None:
            return token_rows_and_positions(self, num_tokens)
        return self.token_rows[:num_tokens], self.token_positions[:num_tokens]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    def decode_context(self, window: int | None = None) -> DecodeContext:
        """The decode rows' slots [B_dec, S] and mask (`decode_slots`, `decode_mask` for full
        attention) for a layer that sees the last `window` positions, None: all of them."""
        assert self.decode_slots is not None, "decode rows need decode_slots"
        longest = max(self.seq_lens_host[: self.num_decodes])
        if window is None or longest <= window:
            return self.decode_slots, self.decode_mask
        assert self.decode_windows is not None, "sliding-window decode rows need decode_windows"
        return self.decode_windows.context(window)


def token_rows_and_positions(
    metadata: PagedAttentionMetadata, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query token's row and position (its row's last `query_len` positions), computed on
    the device from the metadata's tensors: no host round trip."""
    starts = metadata.query_start_loc
    query_lens = starts[1:] - starts[:-1]
    rows = torch.repeat_interleave(
        torch.arange(query_lens.shape[0], device=starts.device), query_lens, output_size=num_tokens
    )
    index = torch.arange(num_tokens, device=starts.device)
    positions = index - starts[rows] + metadata.seq_lens[rows] - query_lens[rows]
    return rows.to(torch.int32), positions.to(torch.int32)
