"""Splits chat-completion output into reasoning (`<think>…</think>`) and content, incrementally.

Feeding a text whole or in arbitrary chunks gives the same concatenated reasoning and content:
text that may be the start of a tag is held back until more text (or `finish`) decides it, and
every newline-stripping decision is taken on a character that is already certain.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
# Qwen3 writes "</think>\n\n" before its answer; at most this many newlines are dropped there.
CONTENT_NEWLINES_AFTER_THINK = 2


def partial_tag_length(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (0 when none).

    That suffix may still become `tag` when more text arrives, so a streaming parser holds it back.
    """
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


def split_partial_tag(text: str, tag: str) -> tuple[str, str]:
    """`(certain, held)`: `held` is the tail of `text` that may be the start of `tag`."""
    cut = len(text) - partial_tag_length(text, tag)
    return text[:cut], text[cut:]


@dataclass(frozen=True)
class ReasoningSplit:
    reasoning: str = ""
    content: str = ""


class ReasoningSplitter:
    """Routes text inside `<think>…</think>` to reasoning and the rest to content.

    Any number of think blocks is recognised; tags themselves are dropped. Newlines are stripped
    where Qwen3 writes them as layout: every leading newline of a reasoning block (so the empty
    block "<think>\\n\\n</think>" yields no reasoning), and up to two newlines right after
    `</think>`. A `</think>` outside reasoning and a `<think>` inside it are plain text, except
    that with `starts_in_reasoning` (the prompt already opened the block) a `<think>` at the very
    start of the output is dropped as redundant. Unclosed reasoning stays reasoning at `finish`.
    Not to be fed after `finish`.
    """

    def __init__(self, *, starts_in_reasoning: bool = False) -> None:
        self._in_reasoning = starts_in_reasoning
        self._check_redundant_open = starts_in_reasoning
        self._strip_reasoning_newlines = starts_in_reasoning
        self._content_newlines_to_drop = 0
        # Text not yet returned: a possible tag prefix, or the start checked for a redundant tag.
        self._buffer = ""

    def feed(self, text: str) -> ReasoningSplit:
        self._buffer += text
        reasoning: list[str] = []
        content: list[str] = []
        while self._step(reasoning, content):
            pass
        return ReasoningSplit("".join(reasoning), "".join(content))

    def finish(self) -> ReasoningSplit:
        """Flush the held text: a partial tag is text of whichever side it was held on."""
        reasoning: list[str] = []
        content: list[str] = []
        self._check_redundant_open = False
        self._emit(self._buffer, reasoning, content)
        self._buffer = ""
        return ReasoningSplit("".join(reasoning), "".join(content))

    def _step(self, reasoning: list[str], content: list[str]) -> bool:
        """One transition over the buffer; False once it must wait for more text."""
        if self._check_redundant_open:
            if len(self._buffer) < len(THINK_OPEN) and THINK_OPEN.startswith(self._buffer):
                return False
            self._check_redundant_open = False
            if self._buffer.startswith(THINK_OPEN):
                self._buffer = self._buffer[len(THINK_OPEN) :]
            return True
        tag = THINK_CLOSE if self._in_reasoning else THINK_OPEN
        at = self._buffer.find(tag)
        if at < 0:
            certain, self._buffer = split_partial_tag(self._buffer, tag)
            self._emit(certain, reasoning, content)
            return False
        self._emit(self._buffer[:at], reasoning, content)
        self._buffer = self._buffer[at + len(tag) :]
        self._in_reasoning = not self._in_reasoning
        self._strip_reasoning_newlines = self._in_reasoning
        self._content_newlines_to_drop = 0 if self._in_reasoning else CONTENT_NEWLINES_AFTER_THINK
        return True

    def _emit(self, piece: str, reasoning: list[str], content: list[str]) -> None:
        # Stripping state changes only on real characters, so where chunks happen to end cannot
        # change what is stripped.
        if not piece:
            return
        if self._in_reasoning:
            if self._strip_reasoning_newlines:
                piece = piece.lstrip("\n")
                self._strip_reasoning_newlines = not piece
            reasoning.append(piece)
            return
        while self._content_newlines_to_drop and piece.startswith("\n"):
            piece = piece[1:]
            self._content_newlines_to_drop -= 1
        if piece:
            self._content_newlines_to_drop = 0
        content.append(piece)
