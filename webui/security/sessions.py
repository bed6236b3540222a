"""Logged-in sessions, kept in memory (a console restart logs everyone out), each with its own
CSRF token. The browser holds only an opaque random token in an HttpOnly, SameSite=Strict cookie.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

SESSION_COOKIE = "dgpp_console"
LOGIN_COOKIE = "dgpp_login"  # the login form's CSRF token, before any session exists
CSRF_FIELD = "csrf_token"
CSRF_HEADER = "x-csrf-token"


@dataclass(frozen=True)
class Session:
    username: str
    csrf_token: str
    expires_at: float


def _key(token: str) -> str:
    # Stored by digest, so the table itself holds nothing a browser could present.
    return hashlib.sha256(token.encode()).hexdigest()


class SessionStore:
    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.time) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()

    def create(self, username: str) -> tuple[str, Session]:
        """A new session; (the cookie's token, the session)."""
        token = secrets.token_urlsafe(32)
        session = Session(username, secrets.token_urlsafe(32), self.clock() + self.ttl_s)
        with self._lock:
            self._drop_expired()
            self._sessions[_key(token)] = session
        return token, session

    def get(self, token: str | None) -> Session | None:
        if not token:
            return None
        with self._lock:
            session = self._sessions.get(_key(token))
            if session is not None and session.expires_at <= self.clock():
                del self._sessions[_key(token)]
                return None
            return session

    def delete(self, token: str | None) -> None:
        if token:
            with self._lock:
                self._sessions.pop(_key(token), None)

    def _drop_expired(self) -> None:
        now = self.clock()
        for key in [key for key, s in self._sessions.items() if s.expires_at <= now]:
            del self._sessions[key]
