"""Speculative decoding by n-gram (prompt) lookup, and exact verification of the drafts.

Drafting: the last `n` tokens of a request (n from `ngram_max` down to `ngram_min`) are looked
up in its own history, prompt included; the tokens that followed their latest earlier occurrence
are the draft. Agents and editors repeat their context (file contents, tool output, code being
rewritten), so such drafts are often right, and a draft costs no model at all.

Verification: the engine runs the request's last token and its `k` draft tokens as one row of
`k + 1` queries, then samples position 0, 1, ... in order with the request's own sampling
parameters, penalties and generator, and stops at the first token that differs from the draft.
Every token emitted is therefore drawn exactly as plain decoding would draw it: greedy output is
identical, and a seeded request consumes its generator identically, so its output is identical
too. For a draft that is a single token (as lookup drafts are), accepting iff the sampled token
equals it is the rejection-sampling rule of speculative sampling: accepted with probability
p(draft), otherwise a sample from p with the draft removed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from dgpp.engine.scheduling.request import Request


class Proposer(Protocol):
    """What the scheduler asks for a request's draft (`NgramProposer`, the MTP drafter)."""

    def propose(self, request: Request, limit: int) -> tuple[int, ...]: ...


class NgramProposer:
    """Proposes up to `depth` tokens per request from the request's own history."""

    def __init__(self, depth: int, ngram_max: int, ngram_min: int) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
        if depth < 1:
            raise ValueError(f"depth must be positive, got {depth}")
        self.depth = depth
        self.ngram_max = ngram_max
        self.ngram_min = ngram_min

    def propose(self, request: Request, limit: int) -> tuple[int, ...]:
        """At most min(depth, limit) draft tokens for `request`; () when nothing matches."""
        limit = min(self.depth, limit)
        if limit < 1 or request.num_tokens <= self.ngram_min:
            return ()
        return lookup(_history(request), self.ngram_max, self.ngram_min, limit)


def lookup(tokens: np.ndarray, ngram_max: int, ngram_min: int, limit: int) -> tuple[int, ...]:
    """The tokens after an earlier occurrence of the longest suffix n-gram of `tokens` (n in
    [ngram_min, ngram_max]) that occurs earlier, at most `limit` of them: the latest occurrence
    with `limit` tokens after it, else the latest."""
    length = len(tokens)
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        suffix = tokens[length - n :]
        # Candidate starts 0 .. length - n - 1: every occurrence except the suffix itself.
        windows = length - n
        hits = tokens[:windows] == suffix[0]
        for offset in range(1, n):
            hits &= tokens[offset : windows + offset] == suffix[offset]
        found = np.flatnonzero(hits)
        if found.size:
            # The latest occurrence followed by a whole draft; in a run such as "8 8 8 8" the
            # latest of all is followed by one token only.
            whole = found[found + n + limit <= length]
            start = int(whole[-1] if whole.size else found[-1]) + n
            return tuple(int(t) for t in tokens[start : start + limit])
    return ()


@dataclass
class _History:
    """A request's tokens as an array, grown in place as tokens are appended."""

    buffer: np.ndarray
    size: int = 0


def _history(request: Request) -> np.ndarray:
    """`request.token_ids` as an int64 array, kept on the request and extended incrementally (a
    long agent prompt is converted once, not once per step)."""
    history: _History | None = request.spec_history
    tokens = request.token_ids
    if history is None or history.size > len(tokens):
        history = _History(np.empty(max(64, 2 * len(tokens)), dtype=np.int64))
        request.spec_history = history
    if len(tokens) > len(history.buffer):
        grown = np.empty(2 * len(tokens), dtype=np.int64)
        grown[: history.size] = history.buffer[: history.size]
        history.buffer = grown
    if history.size < len(tokens):
        history.buffer[history.size : len(tokens)] = tokens[history.size :]
        history.size = len(tokens)
    return history.buffer[: history.size]
