"""Agent sessions in the prefix cache: which cached blocks belong to whom, and in what order
they are given up.

A request may carry a session (`SamplingParams.session`: OpenAI's `prompt_cache_key`,
Anthropic's `metadata.user_id`, an `x-session-id` header). The blocks a session's requests
computed or reused are its own until another session reuses them. When a tier needs room it
gives up, in this order (`SessionLru.pop`):

1. anonymous blocks (no session), least recently used first;
2. then sessions' blocks, the least recently seen session first (so sessions idle past
   `session_ttl_s`, expired, go before live ones, and live ones oldest first), each session's
   own blocks least recently used first.

A session an agent paused for a minute to run its tests therefore keeps its context against a
batch job's traffic. Each tier (the device pool's evictable blocks, the host tier's slots) keeps
its own `SessionLru` over one `SessionTable`; a block the device gives up goes down to the host
tier with its session (`HostTier.spill`), so a session's blocks move down the tiers before any
is dropped. Releasing a session (`DELETE /v1/sessions/{id}`) makes its blocks anonymous.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Hashable
from dataclasses import dataclass, replace
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
MAX_SESSIONS = 4096  # sessions remembered; the least recently seen is forgotten past this


@dataclass
class SessionInfo:
    last_seen: float  # time.monotonic() of its latest request
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0  # prompt tokens that came from some tier of the prefix cache


class SessionTable:
    def __init__(self, ttl_s: float = 600.0) -> None:
        self.ttl_s = ttl_s
        self._sessions: OrderedDict[str, SessionInfo] = OrderedDict()  # least recently seen first

    def __contains__(self, session: object) -> bool:
        return session in self._sessions

    def __len__(self) -> int:
        return len(self._sessions)

    def seen(self, session: str, now: float | None = None) -> None:
        """A request of `session` arrived."""
        now = time.monotonic() if now is None else now
        info = self._sessions.pop(session, None) or SessionInfo(now)
        info.last_seen = now
        self._sessions[session] = info
        while len(self._sessions) > MAX_SESSIONS:
            self._sessions.popitem(last=False)

    def record(self, session: str, prompt_tokens: int, hit_tokens: int) -> None:
        """A request of `session` was admitted with `hit_tokens` of its prompt cached."""
        info = self._sessions.get(session)
        if info is not None:
            info.requests += 1
            info.prompt_tokens += prompt_tokens
            info.hit_tokens += hit_tokens

    def last_seen(self, session: str) -> float:
        """When the session was last seen; minus infinity once forgotten or released."""
        info = self._sessions.get(session)
        return float("-inf") if info is None else info.last_seen

    def release(self, session: str) -> bool:
        return self._sessions.pop(session, None) is not None

    def expired(self, session: str, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        return now - self.last_seen(session) > self.ttl_s

    def snapshot(self) -> dict[str, SessionInfo]:
        """A copy, for readers on other threads."""
        return {name: replace(info) for name, info in list(self._sessions.items())}


class SessionLru(Generic[K]):
    """Keys (device blocks or host-tier keys) in the order a tier gives them up (see the module
    docstring)."""

    def __init__(self, sessions: SessionTable | None = None) -> None:
        self.sessions = sessions
        self._anonymous: OrderedDict[K, None] = OrderedDict()
        self._by_session: dict[str, OrderedDict[K, None]] = {}
        self._owner: dict[K, str | None] = {}

    def __len__(self) -> int:
        return len(self._owner)

    def __contains__(self, key: object) -> bool:
        return key in self._owner

    def owner(self, key: K) -> str | None:
        return self._owner.get(key)

    def add(self, key: K, session: str | None = None) -> None:
        """`key` is the newest of `session`'s (anonymous: None); a key already held keeps its
        session unless `session` names one."""
        previous = self._owner.get(key)
        self.discard(key)
        owner = session if session is not None else previous
        if owner is not None and self.sessions is not None and owner not in self.sessions:
            owner = None  # released or forgotten: anonymous
        self._owner[key] = owner
        if owner is None:
            self._anonymous[key] = None
        else:
            self._by_session.setdefault(owner, OrderedDict())[key] = None

    def touch(self, key: K) -> None:
        """`key` was used: the newest of its class."""
        owner = self._owner.get(key, False)
        if owner is False:
            return
        (self._anonymous if owner is None else self._by_session[owner]).move_to_end(key)

    def discard(self, key: K) -> None:
        if key not in self._owner:
            return
        owner = self._owner.pop(key)
        if owner is None:
            del self._anonymous[key]
            return
        keys = self._by_session[owner]
        del keys[key]
        if not keys:
            del self._by_session[owner]

    def yields_to(self, session: str | None) -> bool:
        """Whether the next key to give up ranks below a new key of `session`'s: anonymous,
        or (for a session) a session seen no later. An anonymous block never takes a session's
        place."""
        if self._anonymous or not self._by_session:
            return True
        if session is None:
            return False
        table = self.sessions
        if table is None:
            return True
        return min(table.last_seen(s) for s in self._by_session) <= table.last_seen(session)

    def pop(self) -> tuple[K, str | None] | None:
        """The next key to give up and its session (both removed), or None when empty."""
        if self._anonymous:
            key, _ = self._anonymous.popitem(last=False)
            del self._owner[key]
            return key, None
        if not self._by_session:
            return None
        table = self.sessions
        oldest = min(self._by_session, key=lambda s: table.last_seen(s) if table else 0.0)
        key = next(iter(self._by_session[oldest]))
        self.discard(key)
        return key, oldest

    def release(self, session: str) -> None:
        """The session ended: its keys become anonymous, the oldest of them first."""
        keys = self._by_session.pop(session, OrderedDict())
        for key in reversed(keys):
            self._owner[key] = None
            self._anonymous[key] = None
            self._anonymous.move_to_end(key, last=False)

    def counts(self) -> dict[str, int]:
        """Keys held per session."""
        return {session: len(keys) for session, keys in list(self._by_session.items())}


class SessionBook:
    """Rank 0's sessions across the tiers: the table, the tiers' orders over it, and the
    releases other threads ask for (applied by the engine thread at its next step)."""

    def __init__(self, table: SessionTable, tiers: dict[str, SessionLru]) -> None:
        """`tiers`: each tier's order by name ("device", "host"), joined to `table`."""
        self.table, self.tiers = table, tiers
        for order in tiers.values():
            order.sessions = table
        self._releases: deque[str] = deque()  # appended from any thread

    def release(self, session: str) -> None:
        """Ask for `session` to end (thread-safe): its blocks become anonymous next step."""
        self._releases.append(session)

    def apply_releases(self) -> None:
        while self._releases:
            session = self._releases.popleft()
            self.table.release(session)
            for order in self.tiers.values():
                order.release(session)

    def rows(self, block_size: int, now: float | None = None) -> list[dict[str, object]]:
        """Every remembered session, most recently seen first: its tokens held per tier (cached
        blocks no request uses: what an eviction could take), when it was last seen, whether it
        has expired, and the share of its prompt tokens that came from the cache."""
        now = time.monotonic() if now is None else now
        counts = {name: order.counts() for name, order in self.tiers.items()}
        rows = []
        for session, info in reversed(self.table.snapshot().items()):
            rows.append(
                {
                    "id": session,
                    "idle_s": round(now - info.last_seen, 3),
                    "expired": now - info.last_seen > self.table.ttl_s,
                    "tokens": {n: c.get(session, 0) * block_size for n, c in counts.items()},
                    "requests": info.requests,
                    "prompt_tokens": info.prompt_tokens,
                    "hit_tokens": info.hit_tokens,
                    "hit_rate": info.hit_tokens / info.prompt_tokens
                    if info.prompt_tokens
                    else None,
                }
            )
        return rows
