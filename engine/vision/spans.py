"""Where a prompt's images sit and what they make of positions and chunks.

An image stands in the prompt as a run of placeholder tokens (`ImageSpan`: its first token's
index, its grid of merged patches, a digest of its pixels). Everything downstream follows from
the spans alone: the M-RoPE positions of any chunk of the prompt (`chunk_positions`: each image
token its (time, row, column) from the position its image starts at, as transformers'
`get_rope_index`), the position shift of the text after the images (`shift_at`:
decoded tokens sit at their index plus the request's whole shift, all three axes equal, so a
decode step is plain rotary at a shifted position), where a prefill chunk may end
(`chunk_end`: never inside an image) and what a prefix-cache block's key mixes in besides its
tokens (`block_images`: the digests of the images it holds, so two screenshots never share a
cached block).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Ints of a span on the wire (`dgpp.engine.execution.step_message`).
SPAN_FIELDS = 5


@dataclass(frozen=True)
class ImageSpan:
    """An image's placeholder run: tokens `offset .. offset + tokens`, `t * rows * cols` of
    them (the grid in merged patches), and the digest of its pixels and grid."""

    offset: int
    t: int
    rows: int
    cols: int
    digest: int

    @property
    def tokens(self) -> int:
        return self.t * self.rows * self.cols

    @property
    def end(self) -> int:
        return self.offset + self.tokens

    @property
    def advance(self) -> int:
        """How far the image moves the position counter (the larger side of its grid)."""
        return max(self.rows, self.cols)

    def patch_grid(self, merge: int) -> tuple[int, int, int]:
        """(t, h, w) in patches, as the encoder takes it."""
        return self.t, self.rows * merge, self.cols * merge

    def to_values(self) -> list[int]:
        return [self.offset, self.t, self.rows, self.cols, self.digest]


@dataclass(frozen=True)
class PromptImage:
    """An image of a prompt as rank 0 holds it: its span, its processor pixels (the encoder's
    input), and its sizes before and after the server resized it (coordinate mapping)."""

    span: ImageSpan
    pixel_values: torch.Tensor  # [t * h * w, patch_dim] float32
    original_size: tuple[int, int] = (0, 0)  # (width, height) as sent
    resized_size: tuple[int, int] = (0, 0)  # (width, height) the model saw


def image_digest(pixel_values: torch.Tensor, grid: tuple[int, int, int]) -> int:
    """A 63-bit digest of an image's encoder input (pixels and grid): equal images, equal
    digests, in every process (the encoder cache and the prefix cache key on it)."""
    hasher = hashlib.blake2b(digest_size=8)
    hasher.update(repr(tuple(grid)).encode())
    hasher.update(pixel_values.detach().to(torch.float32).contiguous().numpy().tobytes())
    return int.from_bytes(hasher.digest(), "little") >> 1


def shift_at(spans: Sequence[ImageSpan], index: int) -> int:
    """Position minus token index of a text token at `index` (or after every image that ends
    by then): each image before it moves positions by its advance instead of its tokens."""
    return sum(span.advance - span.tokens for span in spans if span.end <= index)


def overlapping(spans: Sequence[ImageSpan], start: int, end: int) -> tuple[ImageSpan, ...]:
    """The spans with a token in `start .. end`."""
    return tuple(span for span in spans if span.offset < end and span.end > start)


def chunk_positions(spans: Sequence[ImageSpan], shift: int, start: int, end: int) -> torch.Tensor:
    """M-RoPE positions [3, end - start] of prompt tokens `start .. end`, given the `spans`
    overlapping them and the shift of the text before the first of those."""
    parts: list[torch.Tensor] = []
    at = start
    for span in sorted(spans, key=lambda s: s.offset):
        if span.offset > at:  # text before the image
            parts.append(torch.arange(at, span.offset).expand(3, -1) + shift)
        base = span.offset + shift
        grid = torch.meshgrid(
            torch.arange(span.t), torch.arange(span.rows), torch.arange(span.cols), indexing="ij"
        )
        whole = torch.stack(grid).reshape(3, -1) + base
        first, last = max(start, span.offset), min(end, span.end)
        parts.append(whole[:, first - span.offset : last - span.offset])
        shift += span.advance - span.tokens
        at = span.end
    if at < end:
        parts.append(torch.arange(at, end).expand(3, -1) + shift)
    return torch.cat(parts, dim=1) if parts else torch.zeros(3, 0, dtype=torch.long)


def chunk_end(spans: Sequence[ImageSpan], start: int, end: int) -> int:
    """Where a prefill chunk `start .. end` ends so that it splits no image: before an image
    it would cut, or past the end of one it starts inside (even beyond its token budget)."""
    for span in spans:
        if span.offset < end < span.end:
            return span.offset if span.offset > start else span.end
    return end


def block_images(
    spans: Sequence[ImageSpan], block_size: int, num_blocks: int, first_block: int = 0
) -> dict[int, tuple[int, ...]]:
    """For each full block `first_block .. num_blocks` holding image tokens: the digests and
    offsets of those images, which its prefix-cache key mixes in (the blocks whose keys are
    known already are skipped)."""
    out: dict[int, tuple[int, ...]] = {}
    for span in spans:
        first = max(span.offset // block_size, first_block)
        last = min((span.end - 1) // block_size, num_blocks - 1)
        for block in range(first, last + 1):
            out[block] = (*out.get(block, ()), span.offset, span.digest)
    return out


def check_spans(token_ids: Sequence[int], spans: Sequence[ImageSpan], image_token: int) -> None:
    """Refuse spans that are not the prompt's placeholder runs, in order (ValueError)."""
    at = 0
    for span in spans:
        if span.t != 1 or span.rows < 1 or span.cols < 1:
            raise ValueError(f"image grid {(span.t, span.rows, span.cols)} is not an image's")
        if span.offset < at or span.end > len(token_ids):
            raise ValueError("image spans overlap or run past the prompt")
        if any(token != image_token for token in token_ids[span.offset : span.end]):
            raise ValueError(f"image span at {span.offset} is not a run of image tokens")
        at = span.end
    placeholders = sum(token == image_token for token in token_ids)
    if placeholders != sum(span.tokens for span in spans):
        raise ValueError(
            f"the prompt holds {placeholders} image tokens, its images "
            f"{sum(span.tokens for span in spans)}"
        )
