"""The one reader of the HTTP keys a deployment names (`http.api_key_file`,
`http.admin_key_file`), for every launch path: `dgpp serve`, `dgpp rank`, the console.

A key file holds the key and nothing else (surrounding whitespace is ignored). A file that is
empty or only whitespace refuses to start: such a key would let every request in. Keys travel
in files (or systemd credentials) and never on a command line, where `ps` shows them.
"""

from __future__ import annotations

import logging
from pathlib import Path

from dgpp.engine.errors import ConfigError
from dgpp.engine.server.core.config import ServerConfig

log = logging.getLogger("dgpp.keys")


def read_key_file(path: str, setting: str) -> str:
    """The key in `path`; `ConfigError` (exit code 3) when it cannot be read or is empty."""
    try:
        text = Path(path).expanduser().read_text()
    except OSError as err:
        raise ConfigError(f"cannot read {setting} {path}: {err.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{setting} {path} is not text; write the key into it") from None
    key = text.strip()
    if not key:
        raise ConfigError(
            f"{setting} {path} is empty: an empty key would let every request in; write the "
            "key into the file (for example `openssl rand -hex 32 > FILE`)"
        )
    return key


def check_key(key: str, setting: str) -> str:
    """A key given directly (`--api-key`): refused when empty, as an empty file is."""
    if not key.strip():
        raise ConfigError(f"{setting} is empty: an empty key would let every request in")
    return key.strip()


def warn_if_unauthenticated(server: ServerConfig, allowed: bool) -> None:
    """Log the deliberate choice `http.allow_unauthenticated` makes, every start."""
    if allowed and server.api_key is None:
        log.warning(
            "serving %s:%d to the network without an API key (http.allow_unauthenticated)",
            server.host,
            server.port,
        )
