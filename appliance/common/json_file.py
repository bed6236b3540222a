"""Reads the JSON objects dgpp keeps in files (deployments, console settings) with one kind of
error for every way that can fail."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dgpp.engine.errors import ConfigError


def read_object(path: Path, what: str) -> dict[str, Any]:
    """The JSON object in `path`; `ConfigError` naming `what` (e.g. "the deployment") when the
    file cannot be read, is not JSON, or holds something else than an object."""
    try:
        raw = json.loads(path.read_text())
    except OSError as err:
        raise ConfigError(f"cannot read {what} {path}: {err.strerror}") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: {what} must be a JSON object")
    return raw
