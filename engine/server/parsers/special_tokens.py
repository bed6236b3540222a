"""Strips the text of special tokens from a stream, for output decoded with them kept.

Formats whose markers are special tokens (output_format.py) have the engine decode with special
tokens kept, so the markers reach the parser; what the client would not have seen with
`skip_special_tokens` (the markers the parser did not consume, any other special token) is then
taken out of the content and the reasoning here. Like the parsers, a filter holds back only a
tail that may still become a special token, so any chunking of a stream gives the same text.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any


class SpecialTokenText:
    """The texts of a tokenizer's special tokens; built once per served model."""

    def __init__(self, texts: Iterable[str]) -> None:
        self.texts = frozenset(text for text in texts if text)
        # Longest first, so that at any offset the longest special text is the one matched.
        ordered = sorted(self.texts, key=lambda text: (-len(text), text))
        self._pattern = re.compile("|".join(map(re.escape, ordered))) if ordered else None
        self._prefixes = frozenset(text[:n] for text in self.texts for n in range(1, len(text)))
        self._longest = max(map(len, self.texts), default=0)

    @classmethod
    def of(cls, tokenizer: Any) -> SpecialTokenText:
        """Every token the tokenizer skips with `skip_special_tokens`: the named ones (bos,
        eos, …) and every added token marked special."""
        texts = set(getattr(tokenizer, "all_special_tokens", ()))
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        texts.update(token.content for token in added.values() if getattr(token, "special", False))
        return cls(texts)

    def held_length(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a special text."""
        for length in range(min(len(text), self._longest - 1), 0, -1):
            if text[-length:] in self._prefixes:
                return length
        return 0

    def cut(self, text: str) -> int:
        """Where `text` can be cut so that the part before it is final: before a tail that may
        still become a special text, and never inside a special text."""
        cut = len(text) - self.held_length(text)
        if self._pattern is not None:
            for match in self._pattern.finditer(text, 0, len(text)):
                if match.start() >= cut:
                    break
                if match.end() > cut:
                    return match.start()
        return cut

    def strip(self, text: str) -> str:
        return self._pattern.sub("", text) if self._pattern is not None else text


class SpecialTokenFilter:
    """One stream (content or reasoning) without special-token text. Not to be fed after
    `finish`."""

    def __init__(self, special: SpecialTokenText) -> None:
        self._special = special
        self._buffer = ""

    def feed(self, text: str) -> str:
        self._buffer += text
        cut = self._special.cut(self._buffer)
        certain, self._buffer = self._buffer[:cut], self._buffer[cut:]
        return self._special.strip(certain)

    def finish(self) -> str:
        held, self._buffer = self._buffer, ""
        return self._special.strip(held)
