"""Why rank 0 stopped, in one line, read from its log tail: what a failed switch reports instead
of "rank 0 failed (exit code 3)".

Rank 0 says why before it exits: a configuration it cannot run is one ERROR line
(`... rank0 ERROR dgpp.head: cannot serve: ConfigError: this rank's memory plan does not fit: ...`,
head_runtime's `_fatal`), a command line or deployment refused before logging starts is
`dgpp: error: ...` (cli.main), and anything unexpected is a Python traceback whose last line
names the exception. The root cause is the last of these in the tail; lines that only report
(INFO, WARNING) never are one. The tail may come from the journal (`journalctl -o short-iso`),
whose prefix is dropped first.
"""

from __future__ import annotations

import re

MAX_CHARS = 1000  # a reason is shown in a banner and a table cell, not as a log

# `2026-12-02T04:18:34+0000 host dgpp-rank0[4242]: ` (journalctl -o short-iso)
_JOURNAL_PREFIX = re.compile(r"^\d{4}-\d\d-\d\dT\S+ \S+ [^\s:]+: ")
# `... rank0 ERROR dgpp.head: message` (logging), `ERROR:    message` (uvicorn)
_LOG_ERROR = re.compile(
    r"(?:^|\s)(?:ERROR|CRITICAL)(?::\s*|\s+)(?:[A-Za-z_][\w.]*: )?(?P<message>\S.*)$"
)
# `dgpp: error: message`, `dgpp serve: error: argument ...` (cli.main, argparse)
_CLI_ERROR = re.compile(r"^dgpp(?: [\w-]+)*: error: (?P<message>\S.*)$")
_TRACEBACK = "Traceback (most recent call last):"
# What rank 0 puts before every fatal reason; the switch says "rank 0 failed" already.
_FATAL_PREFIX = "cannot serve: "


def root_cause(log_tail: str) -> str | None:
    """The last line in `log_tail` that says why rank 0 failed, without its log prefix; None
    when the tail has no error line (the caller then keeps its own words)."""
    lines = [_JOURNAL_PREFIX.sub("", line.rstrip()) for line in log_tail.splitlines()]
    found: tuple[int, str] | None = None
    for index, line in enumerate(lines):
        message = _error_message(line)
        if message is not None:
            found = (index, message)
    traceback = _last_exception(lines)
    if traceback is not None and (found is None or traceback[0] > found[0]):
        found = traceback
    if found is None:
        return None
    message = found[1].removeprefix(_FATAL_PREFIX).strip()
    return message if len(message) <= MAX_CHARS else message[: MAX_CHARS - 1] + "…"


def _error_message(line: str) -> str | None:
    match = _CLI_ERROR.match(line) or _LOG_ERROR.search(line)
    return match.group("message") if match is not None else None


def _last_exception(lines: list[str]) -> tuple[int, str] | None:
    """The exception line ending the last traceback: the first unindented line after its
    header (the frames are indented). None without a traceback, or one cut off."""
    starts = [index for index, line in enumerate(lines) if line.endswith(_TRACEBACK)]
    if not starts:
        return None
    for index in range(starts[-1] + 1, len(lines)):
        line = lines[index]
        if line and not line[0].isspace():
            return index, line
    return None
