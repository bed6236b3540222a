"""The checkpoint's recommended sampling settings (`generation_config.json`), applied where a
request leaves a setting out, as vLLM does by default (`--generation-config auto`): Qwen3 asks
for temperature 0.6, top_p 0.95 and top_k 20, Llama 3.1 for temperature 0.6 and top_p 0.9."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dgpp.engine.checkpoint.config import read_generation_config

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingDefaults:
    """Each value is the checkpoint's, or None where it names none (the API default applies)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    def describe(self) -> str:
        named = {k: v for k, v in self.__dict__.items() if v is not None}
        return ", ".join(f"{k}={v}" for k, v in named.items()) or "none"


# key -> (type, check): values outside these ranges are ignored with a warning.
_CHECKS: dict[str, tuple[type, Any]] = {
    "temperature": (float, lambda v: 0.0 <= v <= 2.0),
    "top_p": (float, lambda v: 0.0 < v <= 1.0),
    "top_k": (int, lambda v: v >= 0),
    "min_p": (float, lambda v: 0.0 <= v <= 1.0),
    "repetition_penalty": (float, lambda v: 0.0 < v <= 2.0),
}


def load_sampling_defaults(checkpoint: Path) -> SamplingDefaults:
    """The sampling keys of `checkpoint/generation_config.json`; none when it is absent or
    unreadable (serving never fails over a recommendation)."""
    raw = read_generation_config(checkpoint)
    values: dict[str, Any] = {}
    for key, (kind, check) in _CHECKS.items():
        value = raw.get(key)
        if value is None:
            continue
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if ok and kind is int:
            ok = float(value).is_integer()
        if ok and math.isfinite(value) and check(kind(value)):
            values[key] = kind(value)
        else:
            log.warning("ignoring %s=%r in %s/generation_config.json", key, value, checkpoint)
    return SamplingDefaults(**values)
