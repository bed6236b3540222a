"""Login throttling: after `max_failures` failed attempts within `window_s`, from one client
address or against one user name, further attempts are refused (429) until the oldest failure
leaves the window. Refused attempts never reach the password check."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable


class LoginLimiter:
    def __init__(
        self, max_failures: int, window_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_failures = max_failures
        self.window_s = window_s
        self.clock = clock
        self._failures: dict[str, deque[float]] = {}
        self._lock = threading.Lock()

    def retry_after(self, *keys: str) -> float:
        """Seconds until an attempt for these keys is allowed again; 0 when it is now."""
        now = self.clock()
        wait = 0.0
        with self._lock:
            for key in keys:
                failures = self._recent(key, now)
                if len(failures) >= self.max_failures:
                    wait = max(wait, failures[0] + self.window_s - now)
        return wait

    def failed(self, *keys: str) -> None:
        now = self.clock()
        with self._lock:
            for key in keys:
                self._recent(key, now).append(now)

    def succeeded(self, *keys: str) -> None:
        with self._lock:
            for key in keys:
                self._failures.pop(key, None)

    def _recent(self, key: str, now: float) -> deque[float]:
        failures = self._failures.setdefault(key, deque())
        while failures and failures[0] + self.window_s <= now:
            failures.popleft()
        return failures
