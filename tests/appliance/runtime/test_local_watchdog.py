"""The local backend's watchdog with real child processes: each feeds it over the sd_notify
protocol as a `dgpp rank` does (`Notifier.from_environment().keep_alive`), is SIGSTOPped for
real, and must be killed and started again, as systemd's `WatchdogSec=` does for `dgpp@rankN`."""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dgpp.appliance.runtime.local_watchdog import WATCHDOG_S, watchdog_seconds
from dgpp.appliance.runtime.local_workers import LocalWorkers
from dgpp.engine.distributed.world_spec import WorldTimeouts
from dgpp.engine.errors import ConfigError

UNIT = Path(__file__).parents[3] / "units" / "dgpp@.service"

# A stand-in for `dgpp rank`: the same notifier calls, then nothing but waiting.
CHILD = """
import sys, threading, time
from dgpp.appliance.runtime.sd_notify import Notifier
notifier = Notifier.from_environment()
notifier.notify(status="child up")
if sys.argv[1] == "ping":
    notifier.keep_alive(threading.Event())
time.sleep(600)
"""


class ScriptWorkers(LocalWorkers):
    """LocalWorkers whose rank 1 runs `CHILD` instead of `dgpp rank`."""

    def __init__(self, mode: str, watchdog_s: float | None) -> None:
        super().__init__(
            2, 0, WorldTimeouts(shutdown_s=5.0), restart_delay_s=0.2, watchdog_s=watchdog_s
        )
        self.mode = mode

    def command(self, rank: int) -> list[str]:
        return [sys.executable, "-c", CHILD, self.mode]


@pytest.fixture
def workers() -> Iterator[Callable[[str, float | None], ScriptWorkers]]:
    started: list[ScriptWorkers] = []

    def make(mode: str, watchdog_s: float | None) -> ScriptWorkers:
        backend = ScriptWorkers(mode, watchdog_s)
        backend.start()
        started.append(backend)
        return backend

    yield make
    for backend in started:
        backend.stop()


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout_s} s: {what}")


def pinging(backend: ScriptWorkers) -> bool:
    inbox = backend._watchdog
    assert inbox is not None
    pid = backend.pids()[1]
    return inbox.silent_for(pid) is not None and inbox.status.get(pid) == "child up"


def pinging_child(workers, watchdog_s: float) -> tuple[ScriptWorkers, int]:
    """A backend whose child pings its watchdog of `watchdog_s`, and that child's pid."""
    backend = workers("ping", watchdog_s)
    wait_until(lambda: pinging(backend), 30, "the child pings")
    return backend, backend.pids()[1]


def pause(pid: int, seconds: float) -> None:
    os.kill(pid, signal.SIGSTOP)
    time.sleep(seconds)
    os.kill(pid, signal.SIGCONT)


def assert_untouched(backend: ScriptWorkers, pid: int) -> None:
    assert backend.pids()[1] == pid and backend.restarts()[1] == 0


def test_a_frozen_rank_is_killed_and_started_again(workers) -> None:
    backend, first = pinging_child(workers, 2.0)
    time.sleep(3.0)  # pinging every 0.67 s: left alone
    assert_untouched(backend, first)

    os.kill(first, signal.SIGSTOP)
    wait_until(lambda: backend.pids()[1] != first, 10, "the frozen child replaced")
    assert backend.restarts()[1] == 1
    wait_until(lambda: pinging(backend), 30, "the new child pings")
    with pytest.raises(ProcessLookupError):
        os.kill(first, 0)  # killed and reaped, not left stopped


def test_a_pause_shorter_than_the_timeout_is_forgiven(workers) -> None:
    backend, pid = pinging_child(workers, 4.0)
    pause(pid, 1.0)
    time.sleep(3.0)
    assert_untouched(backend, pid)


def test_a_stall_of_the_supervisor_itself_is_not_blamed_on_the_rank(workers) -> None:
    """A machine that stalls (a busy VM host) stops the supervisor and the rank alike: when both
    run again, the rank's late pings are waited for, not taken for a freeze."""
    backend, pid = pinging_child(workers, 2.0)
    with backend._lock:  # the supervisor's loop blocks here
        pause(pid, 3.0)
    time.sleep(2.0)
    assert_untouched(backend, pid)


def test_a_rank_that_never_pinged_is_left_to_the_worlds_deadlines(workers) -> None:
    backend = workers("silent", 0.5)
    wait_until(lambda: backend._watchdog.status.get(backend.pids()[1]) == "child up", 30, "up")
    time.sleep(2.0)
    assert backend.restarts()[1] == 0


def test_without_a_watchdog_a_frozen_rank_stays(workers) -> None:
    """The control: the same freeze, no watchdog, nothing happens."""
    backend = workers("ping", None)
    time.sleep(2.0)
    pid = backend.pids()[1]
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(2.0)
        assert_untouched(backend, pid)
    finally:
        os.kill(pid, signal.SIGCONT)


def test_the_default_timeout_is_the_units_watchdog() -> None:
    (value,) = re.findall(r"^WatchdogSec=(\d+)s$", UNIT.read_text(), flags=re.M)
    assert float(value) == WATCHDOG_S


@pytest.mark.parametrize(
    ("text", "expected"), [(None, WATCHDOG_S), ("", WATCHDOG_S), ("0", None), ("2.5", 2.5)]
)
def test_watchdog_seconds_from_the_environment(text: str | None, expected: float | None) -> None:
    environ = {} if text is None else {"DGPP_LOCAL_WATCHDOG_S": text}
    assert watchdog_seconds(environ) == expected


@pytest.mark.parametrize("text", ["abc", "-1", "nan"])
def test_a_bad_watchdog_setting_names_the_variable(text: str) -> None:
    with pytest.raises(ConfigError, match="DGPP_LOCAL_WATCHDOG_S"):
        watchdog_seconds({"DGPP_LOCAL_WATCHDOG_S": text})
