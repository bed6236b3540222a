"""The vision encoder's outputs by image digest, so a repeated image (an agent's screenshot in
every turn of its history) is encoded once.

Every rank holds one and applies the same operations in the same order, the step messages'
(`add` for the images a message encodes, `use` for each image a row reads), so all hold the
same entries: rank 0 plans which images a step must encode from its own (`missing`), and only
those images' pixels cross the cluster link.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Encoded:
    """One image's encoder output: its tokens [n, hidden] and DeepStack features (Qwen3-VL:
    one [n, hidden] per early decoder layer they are added to)."""

    tokens: torch.Tensor
    deepstack: tuple[torch.Tensor, ...] = ()

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])


class EncoderCache:
    """Least recently used entries are dropped once more than `capacity_tokens` image tokens
    are held; the images a step reads are never dropped during it (a step may exceed the
    capacity with them)."""

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity_tokens = capacity_tokens
        self._entries: OrderedDict[int, Encoded] = OrderedDict()
        self.num_tokens = 0
        self.hits = 0  # images a row read that were already encoded
        self.misses = 0  # images encoded

    def __contains__(self, digest: int) -> bool:
        return digest in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def missing(self, digests: Iterable[int]) -> tuple[int, ...]:
        """The distinct `digests` not held, in order: the images a step must encode."""
        return tuple(d for d in dict.fromkeys(digests) if d not in self._entries)

    def add(self, digest: int, encoded: Encoded, keep: Iterable[int] = ()) -> None:
        """Hold `encoded`; drop the least recently used entries not in `keep` while over the
        capacity."""
        self.misses += 1
        self._entries[digest] = encoded
        self.num_tokens += encoded.num_tokens
        kept = set(keep) | {digest}
        for old in list(self._entries):
            if self.num_tokens <= self.capacity_tokens:
                break
            if old not in kept:
                self.num_tokens -= self._entries.pop(old).num_tokens

    def use(self, digest: int, fresh: bool = False) -> Encoded:
        """The entry of `digest`, now the most recently used (`fresh`: encoded this step)."""
        self.hits += not fresh
        self._entries.move_to_end(digest)
        return self._entries[digest]

    def clear(self) -> None:
        """Forget everything (a new world: the other ranks hold nothing)."""
        self._entries.clear()
        self.num_tokens = 0
