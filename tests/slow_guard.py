"""A pytest plugin (tests/conftest.py registers `SlowGuard`): every test whose setup, call and
teardown together took longer than `LIMIT_S` (120 s) and that `tests/slow_tests.txt` does not
name is listed at the end of the run, and the run fails on one that took over twice as long.
That file is the documented allow-list: a test that must be slow says why there, so CI's time
cannot creep up one unnoticed test at a time. The margin is the host's: the same test took
10-35% longer from one CI day to the next (docs/reliability.md), and a listed-but-passing run
must not block a landing on a busy day. `DGPP_SLOW_GUARD=strict` fails on any unlisted test over
the limit; `DGPP_SLOW_GUARD=report` never fails (a debugger)."""

from __future__ import annotations

import fnmatch
import os
from collections import defaultdict
from pathlib import Path

import pytest

LIMIT_S = 120.0
ALLOW_LIST = Path(__file__).with_name("slow_tests.txt")


def allowed_patterns(path: Path = ALLOW_LIST) -> list[str]:
    """The node-id patterns (fnmatch) of the allow-list; `#` starts a comment."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line]


def over_limit(
    durations: dict[str, float], patterns: list[str], limit_s: float = LIMIT_S
) -> tuple[list[tuple[str, float]], list[tuple[str, float]]]:
    """(allowed, unexpected): the tests over `limit_s`, slowest first, split by the list."""
    slow = sorted(
        ((node, seconds) for node, seconds in durations.items() if seconds > limit_s),
        key=lambda item: -item[1],
    )
    allowed = [(n, s) for n, s in slow if any(fnmatch.fnmatch(n, p) for p in patterns)]
    return allowed, [item for item in slow if item not in allowed]


class SlowGuard:
    def __init__(self, limit_s: float = LIMIT_S, allow_list: Path = ALLOW_LIST) -> None:
        self.limit_s = limit_s
        self.allow_list = allow_list
        self.durations: dict[str, float] = defaultdict(float)
        self.allowed: list[tuple[str, float]] = []
        self.unexpected: list[tuple[str, float]] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.durations[report.nodeid] += report.duration

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if hasattr(session.config, "workerinput"):
            return  # an xdist worker: the controller sees every report and decides
        patterns = allowed_patterns(self.allow_list)
        self.allowed, self.unexpected = over_limit(self.durations, patterns, self.limit_s)
        mode = os.environ.get("DGPP_SLOW_GUARD", "")
        fail_s = {"strict": self.limit_s, "report": float("inf")}.get(mode, 2 * self.limit_s)
        if any(seconds > fail_s for _, seconds in self.unexpected):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.allowed and not self.unexpected:
            return
        terminalreporter.section(f"tests over {self.limit_s:g} s")
        for node, seconds in self.allowed:
            terminalreporter.write_line(
                f"{seconds:7.1f} s  {node}  (allowed: tests/slow_tests.txt)"
            )
        for node, seconds in self.unexpected:
            terminalreporter.write_line(
                f"{seconds:7.1f} s  {node}  NOT ON THE ALLOW-LIST", red=True
            )
