"""Qwen4-Exp's hashed n-gram ids (its PLE layers' input), bit for bit transformers'.

For each token and each n-gram order n = 2 .. `ngram_size`, the token and the n - 1 before it
are mixed, `t0 * m0 ^ t1 * m1 ^ ...` in wrapping int64 (`m` per layer, from a splitmix64 of the
seed), and reduced modulo one prime per head (`heads_per_ngram` heads per order, the primes the
first after `ngram_vocab_size_base` in order over every PLE layer's heads), offset into the
layer's one table. A token before the sequence, or across an end-of-sequence token, counts as
that end-of-sequence token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_LAYER_PRIME = 10007


def _splitmix64(value: int) -> int:
    value = (value + _GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * _M1) & _MASK64
    value = ((value ^ (value >> 27)) * _M2) & _MASK64
    return (value ^ (value >> 31)) & _MASK64


def layer_multipliers(vocab_size: int, ngram_size: int, ple_index: int, seed: int) -> list[int]:
    """The odd multipliers of PLE layer `ple_index`, one per position of an n-gram."""
    half = max(1, ((1 << 63) - 1) // max(vocab_size, 1) // 2)
    base = seed + _LAYER_PRIME * ple_index
    return [
        2 * (_splitmix64((base + _GAMMA * (i + 1)) & _MASK64) % half) + 1 for i in range(ngram_size)
    ]


def _is_prime(value: int) -> bool:
    if value < 2 or value % 2 == 0:
        return value == 2
    return all(value % d for d in range(3, math.isqrt(value) + 1, 2))


@cache
def _primes_after(start: int, count: int) -> tuple[int, ...]:
    """The first `count` primes greater than `start`."""
    found: list[int] = []
    value = start
    while len(found) < count:
        value += 1
        if _is_prime(value):
            found.append(value)
    return tuple(found)


@dataclass(frozen=True)
class NgramHashing:
    """One PLE layer's hashing: its multipliers, each head's prime (table size) and offset."""

    ngram_size: int
    heads_per_ngram: int
    eos_token_id: int
    multipliers: tuple[int, ...]
    head_sizes: tuple[int, ...]

    @property
    def num_heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def head_offsets(self) -> tuple[int, ...]:
        offsets, at = [], 0
        for size in self.head_sizes:
            offsets.append(at)
            at += size
        return tuple(offsets)

    @property
    def num_rows(self) -> int:
        return sum(self.head_sizes)

    @classmethod
    def of(cls, raw: dict[str, Any] | Any, ple_index: int) -> NgramHashing:
        ngram, per = int(raw.get("ngram_size", 3)), int(raw.get("heads_per_ngram", 8))
        heads = (ngram - 1) * per
        base = int(raw.get("ngram_vocab_size_base", 20_000_000))
        primes = _primes_after(base - 1, (ple_index + 1) * heads)[ple_index * heads :]
        eos = raw.get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) else eos
        if eos is None:
            raise ValueError("PLE layers need eos_token_id")
        vocab, seed = int(raw["vocab_size"]), int(raw.get("seed", 1234))
        return cls(
            ngram, per, int(eos), tuple(layer_multipliers(vocab, ngram, ple_index, seed)), primes
        )

    def ids(self, history: torch.Tensor) -> torch.Tensor:
        """Table rows [B, L, heads] of every position of token histories [B, L] (int64)."""
        shifted = [self._shift(history, shift) for shift in range(self.ngram_size)]
        device = history.device
        multipliers = torch.tensor(self.multipliers, dtype=torch.int64, device=device)
        sizes = torch.tensor(self.head_sizes, dtype=torch.int64, device=device)
        offsets = torch.tensor(self.head_offsets, dtype=torch.int64, device=device)
        blocks = []
        for order in range(2, self.ngram_size + 1):
            first = (order - 2) * self.heads_per_ngram
            heads = slice(first, first + self.heads_per_ngram)
            mixed = shifted[0] * multipliers[0]
            for position in range(1, order):
                mixed = torch.bitwise_xor(mixed, shifted[position] * multipliers[position])
            ids = torch.remainder(mixed.unsqueeze(-1), sizes[heads].view(1, 1, -1))
            blocks.append(ids + offsets[heads].view(1, 1, -1))
        return torch.cat(blocks, dim=-1)

    def _shift(self, tokens: torch.Tensor, shift: int) -> torch.Tensor:
        """Each position's token `shift` back, or end-of-sequence where that is before the
        history or across an end-of-sequence token (transformers' `_shift_right_ignore_eos`)."""
        if shift == 0:
            return tokens
        batch, length = tokens.shape
        positions = torch.arange(length, device=tokens.device)
        eos_at = torch.where(tokens == self.eos_token_id, positions, -1)
        last_eos = torch.cummax(eos_at, dim=1).values
        before = torch.cat((eos_at.new_full((batch, 1), -1), last_eos[:, :-1]), dim=1)
        in_segment = positions.unsqueeze(0) - (before + 1)
        source = positions - shift
        gathered = tokens.gather(1, source.clamp_min(0).unsqueeze(0).expand(batch, -1))
        valid = (in_segment >= shift) & (source.unsqueeze(0) >= 0)
        return torch.where(valid, gathered, tokens.new_full((), self.eos_token_id))
