"""Grounding coordinates in answers, mapped into the client's own image.

A vision-language model answers "where" with boxes and points in its own frame: Qwen3-VL and
Qwen3.5 write `"bbox_2d": [x1, y1, x2, y2]` and `"point_2d": [x, y]` on a 0-1000 grid over the
image (`RELATIVE`); Qwen2.5-VL-style models in pixels of the image as the server resized it
(`RESIZED`). Either way a client that sent a 1920x1080 screenshot wants pixels of that
screenshot: with `image_coordinates: original` (the default) the numbers of those arrays are
rewritten to the original image's pixels (rounded, within its bounds); `model` leaves the
answer as written. The frame is the request's last image (the one a grounding question is
about).

Streamed answers are rewritten as they go (`CoordinateStream`): text is held back only from the
opening quote of a possible key until its array closes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

RELATIVE, RESIZED = "relative-1000", "resized-pixels"
_ARRAY = re.compile(r'("(?:bbox_2d|point_2d)"\s*:\s*\[)([^\]\[]*)(\])')
_OPEN = re.compile(r'"(?:bbox_2d|point_2d)"\s*(?::\s*(?:\[[^\]\[]*)?)?')
_KEYS = ('"bbox_2d"', '"point_2d"')
_NUMBER = re.compile(r"\s*-?\d+(?:\.\d+)?\s*")


@dataclass(frozen=True)
class ImageFrame:
    """The client's image (`original` width, height), the one the model saw (`resized`), and
    how the model writes coordinates (`convention`)."""

    original: tuple[int, int]
    resized: tuple[int, int]
    convention: str = RELATIVE

    def to_original(self, value: float, axis: int) -> int:
        """One coordinate (axis 0: x, 1: y) in the original image's pixels."""
        size = self.original[axis]
        scale = 1000 if self.convention == RELATIVE else self.resized[axis]
        return min(max(round(value * size / scale), 0), size)

    def from_original(self, pixel: float, axis: int) -> int:
        """What the model writes for an original pixel (the inverse, for tests and docs)."""
        scale = 1000 if self.convention == RELATIVE else self.resized[axis]
        return round(pixel * scale / self.original[axis])

    def rewrite(self, text: str) -> str:
        """`text` with every complete coordinate array mapped to the original image."""
        return _ARRAY.sub(self._array, text)

    def _array(self, match: re.Match[str]) -> str:
        values = match.group(2).split(",")
        if len(values) % 2 or not all(_NUMBER.fullmatch(value) for value in values):
            return match.group(0)  # not pairs of numbers: leave it as written
        mapped = [self.to_original(float(v), index % 2) for index, v in enumerate(values)]
        return f"{match.group(1)}{', '.join(map(str, mapped))}{match.group(3)}"


class CoordinateStream:
    """`ImageFrame.rewrite` over a stream of text pieces: what may still become a coordinate
    array is held until it closes (or the stream ends)."""

    def __init__(self, frame: ImageFrame) -> None:
        self.frame = frame
        self._held = ""

    def feed(self, text: str) -> str:
        buffer = self.frame.rewrite(self._held + text)
        cut = _hold_from(buffer)
        self._held = buffer[cut:]
        return buffer[:cut]

    def finish(self) -> str:
        rest, self._held = self._held, ""
        return self.frame.rewrite(rest)


def _hold_from(buffer: str) -> int:
    """Where the text that may still become a coordinate array starts (len: none)."""
    start = len(buffer)
    quote = buffer.rfind('"')
    for _ in range(2):  # the key's closing quote, then its opening one
        if quote < 0:
            break
        tail = buffer[quote:]
        if _OPEN.fullmatch(tail) or any(key.startswith(tail) for key in _KEYS):
            start = quote
        quote = buffer.rfind('"', 0, quote)
    return start
