"""Request models that ignore fields they do not know, as vLLM does.

Agents and SDKs add request fields with every release (Claude Code's `output_config`,
`context_management`, ...); refusing them breaks the client on its first request, so an unknown
field is dropped and logged once per model and field name. A known field with a wrong type or
value is still refused, naming the field.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

log = logging.getLogger(__name__)

_MAX_REMEMBERED = 4096  # names logged already; past this, further new names are still logged
_logged: set[tuple[str, str]] = set()
_lock = threading.Lock()


def note_ignored(model: str, names: list[str]) -> list[str]:
    """Log each (model, name) the first time it is seen; returns the names logged now."""
    fresh = []
    with _lock:
        for name in names:
            key = (model, name)
            if key in _logged:
                continue
            if len(_logged) < _MAX_REMEMBERED:
                _logged.add(key)
            fresh.append(name)
    for name in fresh:
        log.warning("ignoring the unknown request field %r of %s (logged once)", name, model)
    return fresh


class TolerantModel(BaseModel):
    """Unknown fields are accepted, logged once and dropped."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _drop_unknown(self) -> Any:
        extra = self.__pydantic_extra__
        if extra:
            note_ignored(type(self).__name__, sorted(extra))
            extra.clear()
        return self
