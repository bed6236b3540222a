"""Image spans: chunk positions equal the whole prompt's M-RoPE positions (test_mrope.py: equal
to transformers') sliced at any chunk boundary, the text shift, where chunks may end (never
inside an image), the images a block's key mixes in, and the encoder cache's order of
eviction."""

from __future__ import annotations

import pytest
import torch

from dgpp.engine.vision.encoder_cache import Encoded, EncoderCache
from dgpp.engine.vision.spans import (
    ImageSpan,
    block_images,
    check_spans,
    chunk_end,
    chunk_positions,
    overlapping,
    shift_at,
)

TEXT, IMAGE = 0, 1
# text 3, an image of 2x3 merged patches at 3, text 4, an image of 4x2 at 13, text 2
SPANS = [ImageSpan(3, 1, 2, 3, 111), ImageSpan(13, 1, 4, 2, 222)]
LENGTH = 23


def _types() -> list[int]:
    types = [TEXT] * LENGTH
    for span in SPANS:
        types[span.offset : span.end] = [IMAGE] * span.tokens
    return types


def test_chunk_positions_slice_the_prompts_positions() -> None:
    whole = chunk_positions(SPANS, 0, 0, LENGTH)
    image = [[3] * 6, [3, 3, 3, 4, 4, 4], [3, 4, 5, 3, 4, 5]]  # time, row, column from 3
    assert torch.equal(whole[:, 3:9], torch.tensor(image))
    assert torch.equal(whole[:, 9], torch.full((3,), 9 + 3 - 6))  # text after the first image
    assert shift_at(SPANS, LENGTH) == (3 - 6) + (4 - 8)
    for start in range(LENGTH):
        for end in range(start + 1, LENGTH + 1):
            spans = overlapping(SPANS, start, end)
            got = chunk_positions(spans, shift_at(SPANS, start), start, end)
            assert torch.equal(got, whole[:, start:end]), (start, end)


def test_chunks_never_end_inside_an_image() -> None:
    assert chunk_end(SPANS, 0, 5) == 3  # cut before the image
    assert chunk_end(SPANS, 3, 5) == 9  # started on it: the whole image, past the budget
    assert chunk_end(SPANS, 4, 6) == 9  # a prefix hit ended inside it: the rest of it
    assert chunk_end(SPANS, 0, 9) == 9 and chunk_end(SPANS, 9, 13) == 13
    assert chunk_end(SPANS, 10, 15) == 13 and chunk_end(SPANS, 13, 14) == 21


def test_blocks_holding_image_tokens_name_their_images() -> None:
    assert block_images(SPANS, 4, 5) == {
        0: (3, 111),
        1: (3, 111),
        2: (3, 111),
        3: (13, 222),
        4: (13, 222),
    }
    assert block_images(SPANS, 4, 2) == {0: (3, 111), 1: (3, 111)}  # full blocks only
    assert block_images(SPANS, 16, 2)[0] == (3, 111, 13, 222)  # two images in one block
    assert block_images(SPANS, 4, 5, first_block=2) == {2: (3, 111), 3: (13, 222), 4: (13, 222)}


def test_spans_must_be_the_prompts_placeholder_runs() -> None:
    ids = [9 if kind == IMAGE else 1 for kind in _types()]
    check_spans(ids, SPANS, image_token=9)
    with pytest.raises(ValueError, match="not a run"):
        check_spans(ids, [ImageSpan(2, 1, 2, 3, 1), SPANS[1]], image_token=9)
    with pytest.raises(ValueError, match="holds 14 image tokens"):
        check_spans(ids, SPANS[:1], image_token=9)
    with pytest.raises(ValueError, match="overlap"):
        check_spans(ids, SPANS[::-1], image_token=9)


def test_the_encoder_cache_drops_the_least_recently_used() -> None:
    cache = EncoderCache(capacity_tokens=10)

    def encoded(tokens: int) -> Encoded:
        return Encoded(torch.zeros(tokens, 2))

    cache.add(1, encoded(4))
    cache.add(2, encoded(4))
    cache.use(1)
    cache.add(3, encoded(4))  # over: 2 goes (1 was used since)
    assert 2 not in cache and 1 in cache and 3 in cache
    cache.add(4, encoded(8), keep=[1, 3])  # the step reads 1 and 3: held past the capacity
    assert len(cache) == 3 and cache.num_tokens == 16
    assert cache.missing([4, 2, 2, 5]) == (2, 5)
    assert (cache.hits, cache.misses) == (1, 4)
