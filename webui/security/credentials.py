"""The console's admin login: one user name and a scrypt hash of the password, in a file readable
only by its owner (mode 0600).

The file uses the `KEY=VALUE` lines of an environment file:

    DGPP_WEBUI_USER=admin
    DGPP_WEBUI_PASSWORD_HASH=scrypt$131072$8$1$<salt, base64>$<hash, base64>

A file that holds `DGPP_WEBUI_PASSWORD=<plain text>` instead (what an installer may write before
`dgpp webui set-password` replaces it) is accepted: the password is hashed in memory at load.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from dgpp.engine.errors import ConfigError

log = logging.getLogger(__name__)

USER_KEY = "DGPP_WEBUI_USER"
HASH_KEY = "DGPP_WEBUI_PASSWORD_HASH"
PLAIN_KEY = "DGPP_WEBUI_PASSWORD"
MIN_PASSWORD_LENGTH = 8
# OWASP's scrypt parameters for passwords (N=2^17, r=8, p=1): 128 MiB and about 0.4 s (two
# cores) per check. Hashes made with other parameters still verify with their own.
_N, _R, _P = 2**17, 8, 1
_MAXMEM = 256 * 2**20


@dataclass(frozen=True)
class Credentials:
    username: str
    password_hash: str  # scrypt$N$r$p$salt$hash

    def verify(self, username: str, password: str) -> bool:
        """True when both match; the hash is computed even for a wrong user name, so the time
        taken says nothing about which part was wrong."""
        user_ok = hmac.compare_digest(username.encode(), self.username.encode())
        return verify_password(password, self.password_hash) and user_ok

    def __repr__(self) -> str:  # never the hash in a log line or a traceback
        return f"Credentials(username={self.username!r})"


def hash_password(password: str, salt: bytes | None = None) -> str:
    salt = salt if salt is not None else secrets.token_bytes(16)
    digest = hashlib.scrypt(password.encode(), salt=salt, n=_N, r=_R, p=_P, maxmem=_MAXMEM)
    encode = base64.b64encode
    return f"scrypt${_N}${_R}${_P}${encode(salt).decode()}${encode(digest).decode()}"


def verify_password(password: str, encoded: str) -> bool:
    try:
        scheme, n, r, p, salt_text, hash_text = encoded.split("$")
        if scheme != "scrypt":
            return False
        salt, expected = base64.b64decode(salt_text), base64.b64decode(hash_text)
        digest = hashlib.scrypt(
            password.encode(), salt=salt, n=int(n), r=int(r), p=int(p), maxmem=_MAXMEM
        )
    except (ValueError, TypeError):
        return False
    return hmac.compare_digest(digest, expected)


def _parse(text: str) -> dict[str, str]:
    values = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, _, value = line.partition("=")
        values[key.strip()] = value.strip().strip("'\"")
    return values


def load_credentials(path: Path) -> Credentials:
    """The credentials in `path`; `ConfigError` (without any secret) when missing or invalid."""
    try:
        info = path.stat()
        text = path.read_text()
    except OSError as err:
        raise ConfigError(
            f"cannot read the console credentials {path}: {err.strerror}; "
            "create them with `dgpp webui set-password`"
        ) from None
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("%s is readable by other users; chmod 600 it", path)
    values = _parse(text)
    username = values.get(USER_KEY, "")
    if not username:
        raise ConfigError(f"{path}: {USER_KEY} is missing")
    if values.get(HASH_KEY):
        return Credentials(username, values[HASH_KEY])
    if values.get(PLAIN_KEY):
        log.warning(
            "%s holds a plain-text password; `dgpp webui set-password` replaces it with a hash",
            path,
        )
        return Credentials(username, hash_password(values[PLAIN_KEY]))
    raise ConfigError(f"{path}: neither {HASH_KEY} nor {PLAIN_KEY} is set")


def write_credentials(path: Path, username: str, password: str) -> Credentials:
    """Create or replace the file atomically, mode 0600 from the first byte."""
    if not username or any(c.isspace() or c in "=#'\"" for c in username):
        raise ConfigError("the user name must be non-empty, without spaces, '=', '#' or quotes")
    if len(password) < MIN_PASSWORD_LENGTH:
        raise ConfigError(f"the password must have at least {MIN_PASSWORD_LENGTH} characters")
    credentials = Credentials(username, hash_password(password))
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(f"{USER_KEY}={username}\n{HASH_KEY}={credentials.password_hash}\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temporary, 0o600)  # whatever the umask did
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return credentials
