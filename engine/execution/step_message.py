"""What rank 0 tells every rank about one step, and the block tables that lets them keep.

A message names each scheduled request by its `seq_id` and carries only what changed: the row's
input tokens, its first position, how many of its positions are sampled, and the change to its
block table (blocks kept from the table every rank already holds, blocks appended). Its size
follows the step's work (tokens computed, blocks allocated), never the length of the contexts:
a decode row of a 200K-token request costs the same few integers as one of a 20-token request.
The first row of a request that starts on a prefix-cache hit carries the shared blocks once.

On the wire a message is one int64 tensor (no pickle): the ranks broadcast it as it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dgpp.engine.scheduling.scheduler import StepPlan
from dgpp.engine.vision.spans import SPAN_FIELDS, ImageSpan, overlapping, shift_at

# Header fields (decodes, rows, finished, restores, saves, copies, poll, encode), the finished
# seq ids, the restore and save pairs, the copy triples, the digests to encode; then per row:
# seq_id, start, tokens, sampled, kept blocks, new blocks, state slot, first and stop layer,
# position shift, image spans, followed by its tokens, new blocks and spans.
_HEADER = 8
_ROW_FIELDS = 11


@dataclass(frozen=True)
class StepRow:
    """One scheduled chunk: positions `start .. start + len(token_ids)` of request `seq_id`."""

    seq_id: int
    start: int
    token_ids: tuple[int, ...]  # known tokens from `start`, then a verify row's draft
    num_sampled: int  # trailing positions whose logits are sampled
    num_kept_blocks: int  # leading blocks of the held table that stay
    new_blocks: tuple[int, ...]  # appended after them
    state_slot: int = -1  # the request's recurrent-state slot (hybrid models), else -1
    # A layer slice of a prompt chunk (`dgpp.engine.scheduling.layer_slices`): layers first .. stop
    # only; (0, 0): every layer.
    layers: tuple[int, int] = (0, 0)
    # Vision-language prompts (`dgpp.engine.vision.spans`): position minus index of the row's
    # first text token (images before it run shorter than their tokens), and the images with
    # tokens in the row.
    shift: int = 0
    images: tuple[ImageSpan, ...] = ()

    @property
    def is_slice(self) -> bool:
        return self.layers != (0, 0)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def seq_len(self) -> int:
        """Tokens with keys and values once the row is computed (the draft's included)."""
        return self.start + len(self.token_ids)


@dataclass(frozen=True)
class StepMessage:
    """Decode rows first (`num_decodes` of them), then prefill chunks. `finished` seq ids are
    dropped from the tables before the rows apply. `restores` and `saves` are recurrent-state
    copies (from slot, to slot), before and after the forward; `copies` the host tier's
    (`dgpp.engine.cache.host_tier`) and the disk tier's ops, run in order before the forward; after
    it every rank reports on the `poll` oldest fetches from disk (`dgpp.engine.cache.disk_tier`).
    A message without rows only runs the copies and the poll (waiting a little for fetches).
    `encode` names the images (by digest) the vision encoder runs on before the forward; their
    `pixels` (the images' rows, concatenated in that order) travel beside the message, not in
    its tensor (`dgpp.engine.distributed.control`)."""

    rows: tuple[StepRow, ...]
    num_decodes: int
    finished: tuple[int, ...] = ()
    restores: tuple[tuple[int, int], ...] = ()
    saves: tuple[tuple[int, int], ...] = ()
    copies: tuple[tuple[int, int, int], ...] = ()
    poll: int = 0
    encode: tuple[int, ...] = ()
    pixels: torch.Tensor | None = field(default=None, compare=False, repr=False)

    @property
    def has_prefill(self) -> bool:
        return self.num_decodes < len(self.rows)

    @property
    def num_sampled(self) -> int:
        return sum(row.num_sampled for row in self.rows)

    def token_inputs(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids and positions [T] of the rows (shifted after a row's images)."""
        input_ids: list[int] = []
        positions: list[int] = []
        for row in self.rows:
            input_ids.extend(row.token_ids)
            positions.extend(range(row.start + row.shift, row.seq_len + row.shift))
        ids = torch.tensor(input_ids, dtype=torch.int64, device=device)
        return ids, torch.tensor(positions, dtype=torch.int64, device=device)

    def to_tensor(self) -> torch.Tensor:
        """The message as a flat int64 tensor [N] (see `from_tensor`)."""
        values = [
            self.num_decodes,
            len(self.rows),
            len(self.finished),
            len(self.restores),
            len(self.saves),
            len(self.copies),
            self.poll,
            len(self.encode),
            *self.finished,
        ]
        for pair in (*self.restores, *self.saves):
            values += pair
        for triple in self.copies:
            values += triple
        values += self.encode
        for row in self.rows:
            values += [
                row.seq_id,
                row.start,
                len(row.token_ids),
                row.num_sampled,
                row.num_kept_blocks,
                len(row.new_blocks),
                row.state_slot,
                *row.layers,
                row.shift,
                len(row.images),
            ]
            values += row.token_ids
            values += row.new_blocks
            for span in row.images:
                values += span.to_values()
        return torch.tensor(values, dtype=torch.int64)

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> StepMessage:
        values = tensor.tolist()
        header = values[:_HEADER]
        num_decodes, num_rows, num_finished, num_restores, num_saves, num_copies, poll = header[:7]
        num_encode = header[7]
        at = _HEADER + num_finished
        finished = tuple(values[_HEADER:at])
        pairs = []
        for _ in range(num_restores + num_saves):
            pairs.append((values[at], values[at + 1]))
            at += 2
        copies = []
        for _ in range(num_copies):
            copies.append((values[at], values[at + 1], values[at + 2]))
            at += 3
        encode = tuple(values[at : at + num_encode])
        at += num_encode
        rows = []
        for _ in range(num_rows):
            seq_id, start, num_tokens, num_sampled, kept, num_new, slot, first, stop = values[
                at : at + _ROW_FIELDS - 2
            ]
            shift, num_images = values[at + _ROW_FIELDS - 2 : at + _ROW_FIELDS]
            at += _ROW_FIELDS
            tokens = tuple(values[at : at + num_tokens])
            at += num_tokens
            blocks = tuple(values[at : at + num_new])
            at += num_new
            images = []
            for _ in range(num_images):
                images.append(ImageSpan(*values[at : at + SPAN_FIELDS]))
                at += SPAN_FIELDS
            rows.append(
                StepRow(
                    seq_id,
                    start,
                    tokens,
                    num_sampled,
                    kept,
                    blocks,
                    slot,
                    (first, stop),
                    shift,
                    tuple(images),
                )
            )
        if at != len(values):
            raise ValueError(f"a step message of {len(values)} values holds {at}")
        restores, saves = tuple(pairs[:num_restores]), tuple(pairs[num_restores:])
        return cls(tuple(rows), num_decodes, finished, restores, saves, tuple(copies), poll, encode)


class BlockTables:
    """Each scheduled request's block table as every rank holds it. Only step messages change
    it, applied in the same order on every rank, so all ranks hold the same tables."""

    def __init__(self) -> None:
        self._tables: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self._tables)

    def __getitem__(self, seq_id: int) -> list[int]:
        return self._tables[seq_id]

    def clear(self) -> None:
        """Forget every table (a new world: the other ranks hold none)."""
        self._tables.clear()

    def message(self, plan: StepPlan) -> StepMessage:
        """Rank 0: the message that brings every rank from the tables held now to `plan`'s.
        Changes nothing here; `apply` does, on every rank."""
        rows = []
        for chunk in plan.chunks:
            request = chunk.request
            end = chunk.start + chunk.num_tokens - len(chunk.draft)
            tokens = (*request.token_ids[chunk.start : end], *chunk.draft)
            kept, new = self.change(request.seq_id, request.block_table)
            spans = request.image_spans
            rows.append(
                StepRow(
                    request.seq_id,
                    chunk.start,
                    tokens,
                    chunk.num_sampled,
                    kept,
                    new,
                    request.state_slot,
                    chunk.layers[:2] if chunk.layers is not None else (0, 0),
                    shift_at(spans, chunk.start) if spans else 0,
                    overlapping(spans, chunk.start, end),
                )
            )
        return StepMessage(
            tuple(rows),
            plan.num_decodes,
            plan.finished_seq_ids,
            plan.restores,
            plan.saves,
            plan.copies,
        )

    def apply(self, message: StepMessage) -> None:
        for seq_id in message.finished:
            self._tables.pop(seq_id, None)
        for row in message.rows:
            table = self._tables.setdefault(row.seq_id, [])
            del table[row.num_kept_blocks :]
            table.extend(row.new_blocks)

    def change(self, seq_id: int, table: Sequence[int]) -> tuple[int, tuple[int, ...]]:
        """(blocks of the held table kept, blocks appended) that make it `table`."""
        held = self._tables.get(seq_id, [])
        shared = min(len(held), len(table))
        # Grown, or trimmed (a rejected draft's blocks) and grown again: one C-level compare.
        if list(table[:shared]) == held[:shared]:
            return shared, tuple(table[shared:])
        # Reallocated (preempted, then readmitted): keep what still matches.
        kept = 0
        while held[kept] == table[kept]:
            kept += 1
        return kept, tuple(table[kept:])
