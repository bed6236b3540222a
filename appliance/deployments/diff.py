"""The key-by-key difference of two effective deployments, in the file's words
("engine.kv_capacity"): what the console shows before applying, and what a running rank 0
compares when it reloads (`live_reload`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from dgpp.appliance.deployments.deployment import Deployment


@dataclass(frozen=True)
class Change:
    path: str  # "engine.kv_capacity"
    old: Any
    new: Any

    @property
    def old_text(self) -> str:
        return _text(self.old)

    @property
    def new_text(self) -> str:
        return _text(self.new)


def _text(value: Any) -> str:
    return "(absent)" if value is _ABSENT else json.dumps(value)


_ABSENT = object()


def _flatten(value: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, item in value.items():
        path = f"{prefix}{key}"
        if isinstance(item, dict) and item and path != "http.default_chat_template_kwargs":
            flat.update(_flatten(item, f"{path}."))
        else:
            flat[path] = item
    return flat


def diff(old: Deployment, new: Deployment) -> list[Change]:
    """Every effective key whose value differs, in key order."""
    before = _flatten(old.model_dump(mode="json"))
    after = _flatten(new.model_dump(mode="json"))
    return [
        Change(path, before.get(path, _ABSENT), after.get(path, _ABSENT))
        for path in sorted(before.keys() | after.keys())
        if before.get(path, _ABSENT) != after.get(path, _ABSENT)
    ]
