"""Where the appliance keeps its files, read from the environment at call time.

`data_dir()` holds dgpp's own state (converted checkpoints under `models/`). `hf_hub_cache_dir()`
mirrors huggingface_hub's own lookup but runs on every call, because huggingface_hub freezes these
variables into `huggingface_hub.constants` when it is first imported.
"""

import os
from pathlib import Path

from dgpp.kernels.cache_dir import dgpp_cache_dir


def _env_path(name: str) -> Path | None:
    """The path in environment variable `name`, `~` and `$VARS` expanded; None if unset/empty."""
    value = os.environ.get(name)
    if not value:
        return None
    return Path(os.path.expandvars(value)).expanduser()


def data_dir() -> Path:
    """dgpp's data directory: $DGPP_HOME, else $XDG_DATA_HOME/dgpp, else ~/.local/share/dgpp."""
    home = _env_path("DGPP_HOME")
    if home is not None:
        return home
    xdg = _env_path("XDG_DATA_HOME")
    if xdg is not None and xdg.is_absolute():  # the XDG spec says to ignore relative paths
        return xdg / "dgpp"
    return Path.home() / ".local" / "share" / "dgpp"


def models_dir() -> Path:
    """Where dgpp keeps the checkpoints it installs itself (one directory per model)."""
    return data_dir() / "models"


def hf_hub_cache_dir() -> Path:
    """The hub cache: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        cache = _env_path(name)
        if cache is not None:
            return cache
    hf_home = _env_path("HF_HOME")
    if hf_home is None:
        xdg_cache = _env_path("XDG_CACHE_HOME") or Path.home() / ".cache"
        hf_home = xdg_cache / "huggingface"
    return hf_home / "hub"


def resident_dir() -> Path:
    """Resident weight images: $DGPP_RESIDENT_DIR, else $XDG_CACHE_HOME/dgpp/resident, else
    ~/.cache/dgpp/resident."""
    configured = _env_path("DGPP_RESIDENT_DIR")
    if configured is not None:
        return configured
    return dgpp_cache_dir() / "resident"


def log_root() -> Path:
    """Logs of every deployment this host has run: $DGPP_LOG_DIR, else ~/dgpp/log."""
    return _env_path("DGPP_LOG_DIR") or Path.home() / "dgpp" / "log"


def deployment_log_dir(deployment_id: str) -> Path:
    """One deployment's folder: its resolved configuration and every rank's log."""
    return log_root() / "deployments" / deployment_id


def expanded(text: str, param: str = "model") -> Path:
    """`text` as a path with a leading `~` or `~user` expanded; a `~user` of no such user is a
    `ModelLoadError` naming `param` (pathlib raises a bare RuntimeError for it)."""
    from dgpp.engine.errors import ModelLoadError

    try:
        return Path(text).expanduser()
    except RuntimeError:
        raise ModelLoadError(
            f"{text!r} names the home directory of a user this machine does not have",
            param=param,
        ) from None
