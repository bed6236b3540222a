"""SIGTERM and SIGINT as something a process's main loop waits on, safely.

A Python signal handler runs on the main thread between two of its bytecodes, which may be inside
`threading.Event.wait` while that thread holds the event's internal lock. A handler that calls
`Event.set` then blocks on that lock forever: the process ignores every later SIGTERM and only
SIGKILL ends it. That is how a worker rank outlived its SIGKILLed rank 0 (its PR_SET_PDEATHSIG
SIGTERM arrived inside the main loop's `stop.wait(0.5)`); a loop of `Event.wait(0.0005)` hung on 2
of 200 SIGTERMs. The handler here takes no lock: it records the signal and writes one byte to a
pipe that `wait` selects on.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
from collections.abc import Iterable
from types import FrameType, TracebackType
from typing import Any

STOP = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """Install on the main thread; `wait` there (or anywhere), `wake` from any thread."""

    def __init__(self, signums: Iterable[int] = STOP) -> None:
        self.received: int | None = None  # the first stop signal that came
        self._read, self._write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._previous: dict[int, Any] = {}
        for signum in signums:
            self._previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum
        self.wake()

    def wake(self) -> None:
        """End a `wait` now without a signal (for a thread that has stopped the process)."""
        if self._write < 0:
            return
        # A full pipe already wakes the waiter.
        with contextlib.suppress(OSError):
            os.write(self._write, b"\0")

    def wait(self, timeout_s: float) -> bool:
        """True once a stop signal has come; otherwise wait up to `timeout_s` for one (or for a
        `wake`) and say whether one came."""
        if self.received is None and self._read >= 0:
            # A signal during select runs the handler, whose byte ends the retried select.
            ready, _, _ = select.select([self._read], [], [], timeout_s)
            if ready:
                self._drain()
        return self.received is not None

    def take(self) -> int | None:
        """The signal that came (None: none), forgotten, so that `wait` waits for the next one
        (for a signal that asks for something each time, such as SIGHUP's reload)."""
        received, self.received = self.received, None
        return received

    def _drain(self) -> None:
        try:
            while os.read(self._read, 512):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        """Put the previous handlers back and close the pipe."""
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()
        read, write, self._read, self._write = self._read, self._write, -1, -1
        os.close(read)
        os.close(write)

    def __enter__(self) -> StopSignals:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()
