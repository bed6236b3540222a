"""Stored responses, for `previous_response_id` and `GET`/`DELETE /v1/responses/{id}`.

In memory, bounded by count and age: the oldest entry goes when a new one would exceed
`max_entries`, and an entry older than `ttl_s` is gone (a lookup then misses with a clear 404).
A restart forgets everything, as the prefix cache does; clients that need durable state send
the whole conversation (`store: false`), as Codex does.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dgpp.engine.server.core.errors import APIError
from dgpp.engine.server.openai.protocol import ChatMessage


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]  # the response object, as GET returns it
    conversation: tuple[ChatMessage, ...]  # input and output as chat messages (no instructions)
    stored_at: float


class ResponseStore:
    def __init__(
        self,
        max_entries: int = 1024,
        ttl_s: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._entries)

    def put(self, body: dict[str, Any], conversation: list[ChatMessage]) -> None:
        if self.max_entries <= 0:
            return
        entry = StoredResponse(body, tuple(conversation), self._clock())
        with self._lock:
            self._entries[body["id"]] = entry
            self._entries.move_to_end(body["id"])
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
            self._expire()

    def get(self, response_id: str, param: str = "response_id") -> StoredResponse:
        """The entry, or 404 naming `param` when it is unknown, expired or deleted."""
        with self._lock:
            self._expire()
            entry = self._entries.get(response_id)
        if entry is None:
            raise APIError(
                404,
                f"no stored response with id {response_id!r} (responses are kept in memory for "
                f"{self.ttl_s:g} s, at most {self.max_entries}, and only with store: true)",
                code="response_not_found",
                param=param,
            )
        return entry

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        with self._lock:
            self._entries.pop(response_id, None)

    def _expire(self) -> None:
        """Under the lock: drop entries older than the TTL (the oldest come first)."""
        horizon = self._clock() - self.ttl_s
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if oldest.stored_at >= horizon:
                return
            self._entries.popitem(last=False)
