"""How the console controls the engine's processes: a `ControlBackend` restarts rank 0 with the
deployment file, says what state each rank's process is in, and tails each rank's log.

Two implementations: `SystemdBackend` (a cluster: `dgpp@rankN` units, workers follow rank 0) and
`LocalBackend` (a development box: one `dgpp serve --deployment FILE` child process). Switching
models is the same on both: write the new deployment file, `restart()`, follow `/health`. Both
read earlier runs' logs apart (`log_runs`): systemd each unit's invocations from the journal, the
local backend rank 0's output files of its last runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

BackendKind = Literal["systemd", "local"]


@dataclass(frozen=True)
class RankStatus:
    """One rank's process as its supervisor sees it."""

    rank: int
    state: str  # "running", "starting", "stopped", "failed", "restarting", "unknown"
    pid: int | None = None
    started_at: float | None = None  # wall clock, seconds since the epoch
    detail: str = ""  # the supervisor's own words: unit sub-state, exit code


@dataclass(frozen=True)
class LogRun:
    """One run of a rank's process whose log the backend keeps apart from the others."""

    id: str  # what `log_tail(rank, lines, run=id)` takes
    started_at: float | None  # wall clock, seconds since the epoch; None when unknown
    is_current: bool  # the latest run: running now, or the last one that ran


@dataclass(frozen=True)
class ActionResult:
    """What a start, stop or restart did; `ok` False carries the supervisor's message."""

    ok: bool
    message: str


class ControlBackend(Protocol):
    kind: BackendKind

    @property
    def deployment_path(self) -> Path:
        """The deployment file rank 0 starts from (the console writes it before a restart)."""
        ...

    def start(self) -> ActionResult:
        """Start rank 0 (and, locally, its workers) if it is not running."""
        ...

    def stop(self) -> ActionResult:
        """Stop rank 0 in order (SIGTERM, then a kill after the stop timeout)."""
        ...

    def restart(self) -> ActionResult:
        """Stop rank 0 and start it again from the deployment file; returns once the new process
        is launched, not when it serves (follow `/health` for that)."""
        ...

    def status(self) -> list[RankStatus]:
        """Every rank this backend can see, rank 0 first."""
        ...

    def log_runs(self, rank: int) -> list[LogRun]:
        """The runs of rank `rank` whose logs can be read one by one, newest first; [] when the
        backend keeps that rank's runs in one log."""
        ...

    def log_tail(self, rank: int, lines: int, run: str | None = None) -> str:
        """The last `lines` lines of rank `rank`'s log ("" when it has none): of the run `run`
        (an id from `log_runs`; "" for an id it does not list), or by default the latest lines
        (the current run's, and on the systemd backend the runs before it, read on)."""
        ...


def tail_lines(text: str, lines: int) -> str:
    """The last `lines` lines of `text`."""
    if lines <= 0:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def read_tail(path: Path, lines: int, max_bytes: int = 1 << 20) -> str:
    """The last `lines` lines of a file, reading at most its last `max_bytes`; "" if absent."""
    try:
        with path.open("rb") as handle:
            handle.seek(0, 2)
            size = handle.tell()
            handle.seek(max(0, size - max_bytes))
            data = handle.read()
    except OSError:
        return ""
    return tail_lines(data.decode(errors="replace"), lines)
