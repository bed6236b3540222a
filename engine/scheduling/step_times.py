"""What steps cost, learned from the steps the engine runs: the step-time model behind the
interactive policy's bound (`step_policy`).

A step costs a base (the decode-only step: on a CPU mostly reading every weight once, on a GPU
mostly launching kernels), plus for each prompt chunk of n tokens from position s:

    a * n  +  b * n * (s + n / 2)  +  c * (s + n)  +  d

a: a token through the linear layers; b: a token's attention per earlier position; c: reading
the chunk's whole context once (gathering the cached keys and values); d: a chunk's fixed cost.
The per-chunk terms are why many small chunks cost more than one large one, and a long-context
chunk of a few tokens far more than its tokens suggest. The base is the running average of
decode-only steps; a..d are fitted by non-negative least squares over exponentially weighted
moments of the prompt steps' cost beyond the base, with the fewest terms that explain it. A GPU
fits the same shape: its decode step is launch-bound (the base and d), its prefill
compute-bound (a and b).

The model also keeps the typical short prompt's size, so it can predict a short request's solo
first token (`solo_short_s`): the wait the policy allows an arrival.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

EWMA = 0.2  # weight of the newest decode-only step in the base's running average
DECAY = 0.95  # weight kept by older prompt steps at each new one (about 20 steps of memory)
# Feature scales (a 512-token chunk at 4K positions is about 1 in each), and the ridge that keeps
# the fit determined before the steps have varied enough to tell the terms apart.
SCALES = np.array([512.0, 512.0 * 4096.0, 4096.0, 1.0])
RIDGE = 1e-9
# A term joins the fit only when it explains this much more of the steps' cost (its square).
PARSIMONY = 1e-6
# The short prompt an arrival's wait is sized for: a one-line chat turn, or the shorter ones
# seen lately (the running average of short prompts, capped here: a 200-token prompt counts as
# short too, but must not let a one-line request wait for 200 tokens of long prompt work).
SHORT_TOKENS = 32.0


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - EWMA) * old + EWMA * new


def chunk_features(tokens: int, start: int) -> np.ndarray:
    """The model's terms of one prompt chunk (unscaled): n, n * mean position, end, 1."""
    return np.array([tokens, tokens * (start + tokens / 2), start + tokens, 1.0])


def _nonnegative_fit(gram: np.ndarray, moment: np.ndarray, total: float) -> np.ndarray:
    """argmin over theta >= 0 of the residual `total + theta' G theta - 2 theta' m`, by the
    fewest terms: every subset of free terms is solved (four terms: fifteen small solves), and a
    subset with more terms is taken only when it explains `PARSIMONY` more of `total` than the
    best with fewer. A handful of similar steps (a server's first requests) is then one
    per-token cost, not an exact fit by whichever terms happen to fit them."""
    best, best_loss = np.zeros(len(moment)), total
    for size in range(1, len(moment) + 1):
        size_best, size_loss = best, best_loss
        for free in itertools.combinations(range(len(moment)), size):
            index = list(free)
            try:
                solved = np.linalg.solve(gram[np.ix_(index, index)], moment[index])
            except np.linalg.LinAlgError:
                continue
            if (solved < 0).any():
                continue
            theta = np.zeros(len(moment))
            theta[index] = solved
            loss = total + float(theta @ gram @ theta - 2 * theta @ moment)
            if loss < size_loss:
                size_best, size_loss = theta, loss
        if size_loss < best_loss - PARSIMONY * total:
            best, best_loss = size_best, size_loss
    return best


@dataclass
class StepTimes:
    decode_step_s: float | None = None  # a decode-only step (the base of every step)
    short_tokens: float = SHORT_TOKENS  # running average of short prompts' tokens, capped
    # Weighted moments of the prompt steps: scaled features' Gram matrix and their products with
    # the cost beyond the base; the fitted seconds per scaled term.
    _gram: np.ndarray = field(default_factory=lambda: np.zeros((4, 4)))
    _moment: np.ndarray = field(default_factory=lambda: np.zeros(4))
    _total: float = 0.0  # the weighted sum of the costs' squares
    _theta: np.ndarray | None = None
    _stale: bool = False  # prompt steps observed since the last fit (fitted when next read)
    # The engine thread observes and fits; a metrics reader may fit too (`snapshot`).
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def ready(self) -> bool:
        return self.decode_step_s is not None and (self._theta is not None or self._stale)

    def observe(
        self,
        seconds: float,
        num_decodes: int,
        prompt_chunks: Sequence[tuple[int, int]],
        sliced: tuple[int, int, float] | None = None,
    ) -> None:
        """One step's wall time, its decode rows and its prompt chunks as (start, tokens); a
        chunk computed in a layer slice as (start, tokens, share of the layers): that share of
        a whole step of it (`dgpp.engine.scheduling.layer_slices`), the base's included."""
        if not prompt_chunks and sliced is None:
            if num_decodes:
                self.decode_step_s = _average(self.decode_step_s, seconds)
            return
        features = sum((chunk_features(n, start) for start, n in prompt_chunks), np.zeros(4))
        base = self.decode_step_s or 0.0
        if sliced is not None:
            start, n, share = sliced
            features = features + share * chunk_features(n, start)
            if not (num_decodes or prompt_chunks):  # the slice alone: its share of the base
                base *= share
        features = features / SCALES
        cost = max(seconds - base, 0.0)
        with self._lock:
            self._gram = DECAY * self._gram + np.outer(features, features)
            self._moment = DECAY * self._moment + features * cost
            self._total = DECAY * self._total + cost * cost
            self._stale = True

    def _fitted(self) -> np.ndarray:
        """The terms per unscaled feature, refitted only when steps came since (the fit is some
        0.5 ms of small solves: not paid on steps whose plan never asks for a prediction)."""
        with self._lock:
            if self._stale:
                ridge = RIDGE * max(float(np.trace(self._gram)), 1.0) * np.eye(4)
                fit = _nonnegative_fit(self._gram + ridge, self._moment, self._total)
                self._theta, self._stale = fit / SCALES, False
            assert self._theta is not None
            return self._theta

    def terms(self) -> tuple[float, float, float, float]:
        """(a, b, c, d) of the module docstring, in seconds."""
        a, b, c, d = (float(v) for v in self._fitted())
        return a, b, c, d

    def token_cost(self) -> tuple[float, float]:
        """(a, b): a prompt token at position p costs about a + b * p seconds, beyond its
        chunk's own costs."""
        a, b, _, _ = self.terms()
        return a, b

    def observe_short(self, tokens: int) -> None:
        """A short prompt admitted with `tokens` left to compute (after any cache hit)."""
        self.short_tokens = min(_average(self.short_tokens, float(max(tokens, 1))), SHORT_TOKENS)

    def solo_short_s(self) -> float:
        """The predicted first-token step of a typical short prompt alone."""
        assert self.decode_step_s is not None
        return self.decode_step_s + self.prompt_seconds(round(self.short_tokens), 0)

    def prompt_seconds(self, tokens: int, start: int) -> float:
        """The predicted cost of a chunk computing prompt positions start .. start + tokens
        (nothing when it computes none)."""
        if tokens <= 0:
            return 0.0
        return float(chunk_features(tokens, start) @ self._fitted())

    def chunk_overhead(self, tokens: int, start: int) -> float:
        """What a chunk costs beyond its tokens' own work: reading its context, its fixed cost."""
        _, _, c, d = self.terms()
        return c * (start + tokens) + d

    def context_read(self, start: int) -> float:
        """What reading `start` cached positions costs a chunk (the c term)."""
        return self.terms()[2] * start

    def tokens_within(self, seconds: float, start: int, most: int) -> int:
        """The most prompt tokens from position `start` (at most `most`) whose chunk fits
        `seconds`; 0 when not even its fixed costs do."""
        a, b, c, d = self.terms()
        room = seconds - c * start - d
        if room <= 0:
            return 0
        # (b / 2) n^2 + (a + b * start + c) n <= room
        linear = a + b * start + c
        if b > 0:
            tokens = (-linear + math.sqrt(linear * linear + 2 * b * room)) / b
        elif linear > 0:
            tokens = room / linear
        else:
            return most
        return max(min(math.floor(tokens + 1e-3), most), 0)  # the fit's rounding: not a token

    def snapshot(self) -> dict[str, float | None]:
        """The fitted constants, for `/v1/metrics` and the console (None until fitted)."""
        fitted = self._theta is not None or self._stale
        a, b, c, d = self.terms() if fitted else (None,) * 4
        return {
            "decode_step_s": self.decode_step_s,
            "token_s": a,
            "token_position_s": b,
            "chunk_position_s": c,
            "chunk_s": d,
            "short_prompt_tokens": self.short_tokens,
            "solo_short_s": self.solo_short_s() if self.ready else None,
        }
