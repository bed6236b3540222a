"""StopSignals: a stop signal reaches the main loop even when it lands while the main thread holds
a lock, which `Event.set` in a handler does not survive."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from dgpp.appliance.runtime.stop_signals import StopSignals

# The main thread holds the lock of the Event it waits on (as it does for a few bytecodes of
# every `Event.wait`) when SIGTERM comes; the handler runs at one of the next bytecodes.
INSIDE_THE_LOCK = """
import os, signal, sys, threading
from dgpp.appliance.runtime.stop_signals import StopSignals
stop = threading.Event()
if sys.argv[1] == "event":
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
else:
    signals = StopSignals()
with stop._cond:
    os.kill(os.getpid(), signal.SIGTERM)
    for _ in range(1000):
        pass
seen = stop.is_set() if sys.argv[1] == "event" else signals.wait(0)
print("stopped" if seen else "missed", flush=True)
"""


def _inside_the_lock(handler: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-c", INSIDE_THE_LOCK, handler]
    return subprocess.run(command, capture_output=True, text=True, timeout=5, check=False)


def test_a_signal_inside_the_main_threads_lock_is_seen() -> None:
    done = _inside_the_lock("stop-signals")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "stopped"


def test_the_hazard_is_real_event_set_in_a_handler_hangs_there() -> None:
    """What the worker rank did before: the same program with `Event.set` as the handler never
    ends (the control for the test above)."""
    with pytest.raises(subprocess.TimeoutExpired):
        _inside_the_lock("event")


def test_wait_returns_the_signal_and_close_restores_the_handler() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with StopSignals() as signals:
        assert not signals.wait(0.01)
        os.kill(os.getpid(), signal.SIGTERM)
        assert signals.wait(5.0)
        assert signals.received == signal.SIGTERM
        assert signals.wait(0)  # it stays seen
    assert signal.getsignal(signal.SIGTERM) is before


def test_sigint_stops_too_and_the_first_signal_is_kept() -> None:
    with StopSignals() as signals:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)
        assert signals.wait(5.0)
        assert signals.received == signal.SIGINT


def test_wake_ends_a_wait_without_a_signal() -> None:
    with StopSignals() as signals:
        threading.Timer(0.05, signals.wake).start()
        started = time.monotonic()
        assert not signals.wait(30.0)
        assert time.monotonic() - started < 10.0
        assert signals.received is None
        assert not signals.wait(0.01)  # the wake was drained: the next wait waits


def test_a_wake_after_close_is_harmless() -> None:
    signals = StopSignals()
    signals.close()
    signals.wake()
    assert not signals.wait(0)


def test_take_forgets_the_signal_so_each_sighup_asks_again() -> None:
    """A reload is asked for by every SIGHUP: `take` returns the signal and `wait` then waits
    for the next one."""
    with StopSignals((signal.SIGHUP,)) as reloads:
        assert reloads.take() is None and not reloads.wait(0)
        os.kill(os.getpid(), signal.SIGHUP)
        assert reloads.wait(2.0)
        assert reloads.take() == signal.SIGHUP
        assert not reloads.wait(0.05)  # forgotten until the next one
        os.kill(os.getpid(), signal.SIGHUP)
        assert reloads.wait(2.0) and reloads.take() == signal.SIGHUP
