"""Logged-in sessions, each with its own CSRF token, kept in a SQLite file (mode 0600) in the
console's state directory so a console restart or upgrade logs nobody out (in memory when no file
is given). The browser holds only an opaque random token in an HttpOnly, SameSite=Strict cookie;
the table keeps its SHA-256 digest, never the token itself.

Each session remembers the credentials it was opened under (a digest of the credentials file):
once `dgpp webui set-password` replaces that file, every session opened before is void.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

SESSION_COOKIE = "dgpp_console"
LOGIN_COOKIE = "dgpp_login"  # the login form's CSRF token, before any session exists
CSRF_FIELD = "csrf_token"
CSRF_HEADER = "x-csrf-token"


@dataclass(frozen=True)
class Session:
    username: str
    csrf_token: str
    expires_at: float
    credentials_tag: str  # which credentials it was opened under (`credentials_tag`)


def credentials_tag(path: Path) -> str:
    """A digest of the credentials file as it is now; another value once it is replaced (and
    for a file that cannot be read, which no session was opened under)."""
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()[:32]
    except OSError:
        return "unreadable"


def _key(token: str) -> str:
    # Stored by digest, so the table itself holds nothing a browser could present.
    return hashlib.sha256(token.encode()).hexdigest()


class SessionStore:
    def __init__(
        self, ttl_s: float, clock: Callable[[], float] = time.time, path: Path | None = None
    ) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self._lock = threading.Lock()
        self._db = _open(path)

    def create(self, username: str, tag: str) -> tuple[str, Session]:
        """A new session under the credentials `tag` names; (the cookie's token, the session)."""
        token = secrets.token_urlsafe(32)
        session = Session(username, secrets.token_urlsafe(32), self.clock() + self.ttl_s, tag)
        with self._lock:
            self._db.execute("DELETE FROM sessions WHERE expires_at <= ?", (self.clock(),))
            self._db.execute(
                "INSERT INTO sessions VALUES (?, ?, ?, ?, ?)",
                (_key(token), username, session.csrf_token, session.expires_at, tag),
            )
        return token, session

    def get(self, token: str | None, tag: str) -> Session | None:
        """The live session of `token` opened under the credentials `tag` names, or None (an
        expired session, or one of replaced credentials, is deleted)."""
        if not token:
            return None
        with self._lock:
            row = self._db.execute(
                "SELECT username, csrf_token, expires_at, credentials_tag FROM sessions "
                "WHERE key = ?",
                (_key(token),),
            ).fetchone()
            if row is None:
                return None
            session = Session(*row)
            if session.expires_at <= self.clock() or session.credentials_tag != tag:
                self._db.execute("DELETE FROM sessions WHERE key = ?", (_key(token),))
                return None
            return session

    def delete(self, token: str | None) -> None:
        if token:
            with self._lock:
                self._db.execute("DELETE FROM sessions WHERE key = ?", (_key(token),))

    def close(self) -> None:
        with self._lock:
            self._db.close()


def _open(path: Path | None) -> sqlite3.Connection:
    """The sessions table in `path` (created 0600), or in memory; an unreadable file is moved
    aside and started afresh (its users log in again)."""
    if path is None:
        return _connect(":memory:")
    path.parent.mkdir(parents=True, exist_ok=True)
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
    path.chmod(0o600)
    try:
        return _connect(str(path))
    except sqlite3.DatabaseError as err:
        aside = path.with_name(path.name + ".corrupt")
        log.warning("sessions file %s is unreadable (%s); moved to %s", path, err, aside)
        path.replace(aside)
        return _open(path)


def _connect(target: str) -> sqlite3.Connection:
    db = sqlite3.connect(target, check_same_thread=False, isolation_level=None)
    columns = {row[1] for row in db.execute("PRAGMA table_info(sessions)")}
    if columns and "credentials_tag" not in columns:
        db.execute("DROP TABLE sessions")  # sessions of an older console: log in again
    db.execute(
        "CREATE TABLE IF NOT EXISTS sessions (key TEXT PRIMARY KEY, username TEXT NOT NULL, "
        "csrf_token TEXT NOT NULL, expires_at REAL NOT NULL, credentials_tag TEXT NOT NULL)"
    )
    return db
