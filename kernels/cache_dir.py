"""dgpp's cache directory: $XDG_CACHE_HOME/dgpp (an absolute one; the XDG spec says to ignore
relative paths), else ~/.cache/dgpp. GGUF views, built kernels and resident images live below it."""

from __future__ import annotations

import os
from pathlib import Path


def dgpp_cache_dir() -> Path:
    value = os.environ.get("XDG_CACHE_HOME")
    xdg = Path(os.path.expandvars(value)).expanduser() if value else None
    base = xdg if xdg is not None and xdg.is_absolute() else Path.home() / ".cache"
    return base / "dgpp"
