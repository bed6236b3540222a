"""What steps cost, learned from the steps the engine runs: the step-time model behind the
interactive policy's bound (`step_policy`).

A step costs a base (on a CPU mostly reading every weight once, whatever the rows) plus, per
prompt token, a cost that grows with the token's position (its attention reads every earlier
position). The base is the running average of decode-only steps; the per-token cost is a line
in the position, fitted by least squares over running (exponentially weighted) moments of the
prompt steps' per-token cost against their tokens' mean position.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

EWMA = 0.2  # weight of the newest step in the running averages
MIN_POSITION_SPREAD = 64.0  # positions must vary this much (std) before a slope is fitted


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - EWMA) * old + EWMA * new


@dataclass
class StepTimes:
    decode_step_s: float | None = None  # a decode-only step (the base of every step)
    # Running moments of prompt steps: mean position p, per-token cost y, p*p and p*y.
    _p: float | None = None
    _y: float | None = None
    _pp: float | None = None
    _py: float | None = None

    @property
    def ready(self) -> bool:
        return self.decode_step_s is not None and self._y is not None

    def observe(
        self, seconds: float, num_decodes: int, prompt_chunks: Sequence[tuple[int, int]]
    ) -> None:
        """One step's wall time, its decode rows and its prompt chunks as (start, tokens)."""
        tokens = sum(n for _, n in prompt_chunks)
        if tokens == 0:
            if num_decodes:
                self.decode_step_s = _average(self.decode_step_s, seconds)
            return
        base = self.decode_step_s or 0.0
        y = max(seconds - base, 0.0) / tokens
        p = sum(n * (start + n / 2) for start, n in prompt_chunks) / tokens
        self._p, self._y = _average(self._p, p), _average(self._y, y)
        self._pp, self._py = _average(self._pp, p * p), _average(self._py, p * y)

    def token_cost(self) -> tuple[float, float]:
        """(a, b): a prompt token at position p costs about a + b * p seconds."""
        assert self._p is not None and self._y is not None
        assert self._pp is not None and self._py is not None
        variance = self._pp - self._p**2
        if variance < MIN_POSITION_SPREAD**2:
            return self._y, 0.0
        slope = max((self._py - self._p * self._y) / variance, 0.0)
        return max(self._y - slope * self._p, 0.0), slope

    def prompt_seconds(self, tokens: int, start: int) -> float:
        """The predicted cost of computing prompt positions start .. start + tokens."""
        a, b = self.token_cost()
        return tokens * (a + b * (start + tokens / 2))

    def tokens_within(self, seconds: float, start: int, most: int) -> int:
        """The most prompt tokens from position `start` (at most `most`) that fit `seconds`."""
        if seconds <= 0:
            return 0
        a, b = self.token_cost()
        # tokens * (a + b * start) + (b / 2) * tokens^2 <= seconds
        linear = a + b * start
        if b > 0:
            tokens = (-linear + math.sqrt(linear * linear + 2 * b * seconds)) / b
        elif linear > 0:
            tokens = seconds / linear
        else:
            return most
        return max(min(math.floor(tokens + 1e-9), most), 0)
