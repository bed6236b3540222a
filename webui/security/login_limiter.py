"""Login throttling per client address, with growing delays.

An address's first `max_failures` failed attempts within `window_s` cost nothing; after that each
failure doubles the wait before that address may try again (`base_delay_s`, then twice that, ...,
at most `max_delay_s`). Only the failing address waits: a stranger's guesses never lock anyone
else out of a user name. Refused attempts never reach the password check. Addresses whose
failures have all left the window are forgotten, and at most `max_addresses` are tracked (the
least recently failing go first), so the state stays small under a spray of addresses.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable


class LoginLimiter:
    def __init__(
        self,
        max_failures: int,
        window_s: float,
        clock: Callable[[], float] = time.monotonic,
        base_delay_s: float = 2.0,
        max_delay_s: float = 300.0,
        max_addresses: int = 10_000,
    ) -> None:
        self.max_failures = max_failures
        self.window_s = window_s
        self.clock = clock
        self.base_delay_s = base_delay_s
        self.max_delay_s = max_delay_s
        self.max_addresses = max_addresses
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._failures)

    def retry_after(self, address: str) -> float:
        """Seconds until `address` may try again; 0 when it may now."""
        now = self.clock()
        with self._lock:
            self._prune(now)
            failures = self._failures.get(address)
            if failures is None or len(failures) < self.max_failures:
                return 0.0
            excess = len(failures) - self.max_failures
            delay = min(self.base_delay_s * 2.0**excess, self.max_delay_s)
            return max(0.0, failures[-1] + delay - now)

    def failed(self, address: str) -> None:
        now = self.clock()
        with self._lock:
            failures = self._failures.setdefault(address, deque())
            failures.append(now)
            self._failures.move_to_end(address)
            while len(self._failures) > self.max_addresses:
                self._failures.popitem(last=False)

    def succeeded(self, address: str) -> None:
        with self._lock:
            self._failures.pop(address, None)

    def _prune(self, now: float) -> None:
        for address in list(self._failures):
            failures = self._failures[address]
            while failures and failures[0] + self.window_s <= now:
                failures.popleft()
            if not failures:
                del self._failures[address]
