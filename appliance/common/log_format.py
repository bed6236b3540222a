"""The format of every rank's log line, wherever it goes (standard error, so the journal or the
local backend's output file, and the deployment's `rank<N>.log`):

    2026-12-01T10:00:00.123+01:00 rank0 INFO dgpp.head: ready in ...

The timestamp is ISO 8601 with milliseconds and the UTC offset, so lines of ranks on different
hosts, and of the journal (`short-iso`), sort and compare as they are."""

from __future__ import annotations

import logging
from datetime import datetime

LOG_FORMAT = "%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s"


def log_time(seconds: float) -> str:
    """`seconds` since the epoch as the log lines write it, in this host's time zone."""
    return datetime.fromtimestamp(seconds).astimezone().isoformat(timespec="milliseconds")


def parse_log_time(text: str) -> float | None:
    """The inverse of `log_time`; None for text that is not such a timestamp."""
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None


class RankLogFormatter(logging.Formatter):
    """LOG_FORMAT for one rank, with `log_time` timestamps."""

    def __init__(self, rank: int) -> None:
        super().__init__(LOG_FORMAT.format(rank=rank))

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return log_time(record.created)
