"""Grounding coordinates mapped into the client's image: boxes drawn on an original image land
on the same pixels (within the model's grid) after a round trip through either convention,
whatever the streamed pieces; arrays that are not coordinates stay as written."""

from __future__ import annotations

import random

import pytest

from dgpp.engine.server.chat.coordinates import RELATIVE, RESIZED, CoordinateStream, ImageFrame

FRAMES = [
    ImageFrame((1920, 1080), (1024, 576), RELATIVE),
    ImageFrame((1920, 1080), (1024, 576), RESIZED),
    ImageFrame((333, 777), (320, 768), RESIZED),
]


@pytest.mark.parametrize("frame", FRAMES, ids=["relative", "resized", "odd-sizes"])
def test_a_box_drawn_on_the_original_lands_on_the_same_pixels(frame: ImageFrame) -> None:
    rng = random.Random(0)
    width, height = frame.original
    # the model's grid: 1000 steps, or the resized image's pixels
    step = [width / (1000 if frame.convention == RELATIVE else frame.resized[0]),
            height / (1000 if frame.convention == RELATIVE else frame.resized[1])]  # fmt: skip
    for _ in range(200):
        box = [
            rng.randrange(width),
            rng.randrange(height),
            rng.randrange(width),
            rng.randrange(height),
        ]
        written = [frame.from_original(v, i % 2) for i, v in enumerate(box)]
        answer = f'[{{"bbox_2d": [{", ".join(map(str, written))}], "label": "button"}}]'
        mapped = frame.rewrite(answer)
        numbers = [int(v) for v in mapped.split("[", 2)[2].split("]")[0].split(",")]
        for axis, (got, want) in enumerate(zip(numbers, box, strict=True)):
            assert abs(got - want) <= step[axis % 2] / 2 + 1, (box, numbers)
        assert mapped.endswith('], "label": "button"}]')


def test_points_and_edges() -> None:
    frame = FRAMES[0]
    assert frame.rewrite('{"point_2d": [500, 1000]}') == '{"point_2d": [960, 1080]}'
    assert frame.rewrite('{"point_2d":[0,0]}') == '{"point_2d":[0, 0]}'
    assert frame.rewrite('{"bbox_2d": [1200, -5, 3, 4]}') == '{"bbox_2d": [1920, 0, 6, 4]}'
    for kept in ('{"bbox_2d": [1, 2, 3]}', '{"bbox_2d": ["a", "b"]}', '{"box": [1, 2]}', "[1, 2]"):
        assert frame.rewrite(kept) == kept


def test_a_stream_is_rewritten_whatever_its_pieces() -> None:
    frame = FRAMES[0]
    text = (
        'Found it. [{"bbox_2d": [100, 200, 300, 400], "label": "OK"}, '
        '{"point_2d": [500, 500]}] and "bbox_2d" in prose, "quoted" words.'
    )
    want = frame.rewrite(text)
    assert want != text
    rng = random.Random(1)
    for _ in range(100):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randrange(1, 30)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        stream = CoordinateStream(frame)
        out = "".join(stream.feed(piece) for piece in pieces) + stream.finish()
        assert out == want
    stream = CoordinateStream(frame)  # held only from the key on
    assert stream.feed('Here: {"bbox_2d": [1') == "Here: {"
    assert stream.feed("00, 2") == ""
    assert stream.feed("00, 300, 400]}") == '"bbox_2d": [192, 216, 576, 432]}'
