"""Where a rank gets the cluster secret: the file `DGPP_CLUSTER_SECRET_FILE` (or
`--cluster-secret-file`) names, as the playbook provisions it on every node (0600, readable by
the ranks' user), or `DGPP_CLUSTER_SECRET` (hex) that `dgpp serve --world N` hands the local
ranks it starts. No secret at all leaves the rendezvous open, with a warning from rank 0."""

from __future__ import annotations

import secrets
import stat
from collections.abc import Mapping
from pathlib import Path

from dgpp.engine.errors import ConfigError

FILE_ENV = "DGPP_CLUSTER_SECRET_FILE"
HEX_ENV = "DGPP_CLUSTER_SECRET"
MIN_BYTES = 16


def new_secret() -> bytes:
    return secrets.token_bytes(32)


def read_cluster_secret(path: str | None, env: Mapping[str, str]) -> bytes | None:
    """The secret from `path` (else the environment's file or hex value); None without one.
    `ConfigError` for a file that cannot be read, is open to other users, or is too short."""
    path = path or env.get(FILE_ENV) or None
    if path is None:
        value = env.get(HEX_ENV)
        if not value:
            return None
        try:
            return _checked(bytes.fromhex(value), HEX_ENV)
        except ValueError:
            raise ConfigError(f"{HEX_ENV} is not hexadecimal") from None
    file = Path(path).expanduser()
    try:
        mode = file.stat().st_mode
        data = file.read_bytes().strip()
    except OSError as err:
        raise ConfigError(f"cannot read the cluster secret {file}: {err.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO) & ~stat.S_IRGRP:
        raise ConfigError(f"the cluster secret {file} is open to other users; chmod 0600")
    return _checked(data, str(file))


def secret_env(secret: bytes | None) -> dict[str, str]:
    """The environment that hands `secret` to a local rank process."""
    return {HEX_ENV: secret.hex()} if secret is not None else {}


def _checked(secret: bytes, where: str) -> bytes:
    if len(secret) < MIN_BYTES:
        raise ConfigError(
            f"the cluster secret in {where} has {len(secret)} bytes; use at least {MIN_BYTES} "
            "(for example `openssl rand -hex 32`)"
        )
    return secret
