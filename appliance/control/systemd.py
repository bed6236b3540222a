"""The systemd control backend: `dgpp@rankN` units on this host, driven through `systemctl` and
read through `journalctl`. Only rank 0 is ever restarted: the workers notice, dissolve the world
and follow the new rank 0 (docs/runtime.md).

A unit's runs are its invocations: systemd gives every start a new invocation id, logs its own
messages about the unit (starting, started, exited, stopped) with `INVOCATION_ID=` and stamps
every line of the unit's processes with `_SYSTEMD_INVOCATION_ID=`. The runs are listed from
systemd's own messages (a handful per run, so the listing costs the same however much the rank
logged), a run's log is read by its id."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from dgpp.appliance.control.backend import ActionResult, LogRun, RankStatus, tail_lines

MAX_RANKS = 4  # the largest world the appliance supports; units beyond it are not looked for
MAX_RUNS = 10  # the latest invocations listed
_MANAGER_MESSAGES = 2000  # systemd's latest messages about a unit read to list its invocations
_INVOCATION_ID = re.compile(r"[0-9a-f]{32}")
_PROPERTIES = "Id,LoadState,ActiveState,SubState,MainPID,ExecMainStartTimestamp,ExecMainStatus"
_STATES = {
    "active": "running",
    "activating": "starting",
    "deactivating": "stopping",
    "reloading": "running",
    "inactive": "stopped",
    "failed": "failed",
}


@dataclass(frozen=True)
class CommandResult:
    returncode: int
    stdout: str
    stderr: str


CommandRunner = Callable[[Sequence[str]], CommandResult]


def run_command(argv: Sequence[str], timeout_s: float = 120.0) -> CommandResult:
    """Run `argv` (no shell); a missing program or a timeout is a failed result, not a raise."""
    try:
        done = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except FileNotFoundError:
        return CommandResult(127, "", f"{argv[0]}: command not found")
    except subprocess.TimeoutExpired:
        return CommandResult(124, "", f"{' '.join(argv)} timed out after {timeout_s:.0f} s")
    return CommandResult(done.returncode, done.stdout, done.stderr)


class SystemdBackend:
    kind = "systemd"

    def __init__(
        self,
        deployment_path: Path,
        runner: CommandRunner = run_command,
        systemctl: Sequence[str] = ("systemctl",),
        journalctl: Sequence[str] = ("journalctl",),
        unit: str = "dgpp@rank{rank}",
        world_size: int = MAX_RANKS,
    ) -> None:
        self._deployment_path = deployment_path
        self.runner = runner
        self.systemctl = tuple(systemctl)
        self.journalctl = tuple(journalctl)
        self.unit = unit
        self.max_ranks = max(1, world_size)

    @property
    def deployment_path(self) -> Path:
        return self._deployment_path

    def unit_name(self, rank: int) -> str:
        return self.unit.format(rank=rank)

    def _systemctl(self, *args: str) -> ActionResult:
        result = self.runner([*self.systemctl, *args])
        words = " ".join(args)
        if result.returncode != 0:
            reason = (result.stderr or result.stdout).strip() or f"exit code {result.returncode}"
            return ActionResult(False, f"systemctl {words} failed: {reason}")
        return ActionResult(True, f"systemctl {words}")

    def start(self) -> ActionResult:
        return self._systemctl("start", "--no-block", self.unit_name(0))

    def stop(self) -> ActionResult:
        return self._systemctl("stop", self.unit_name(0))

    def restart(self) -> ActionResult:
        # --no-block: with Type=notify a blocking restart would wait for the whole model load.
        return self._systemctl("restart", "--no-block", self.unit_name(0))

    def status(self) -> list[RankStatus]:
        units = [self.unit_name(rank) for rank in range(self.max_ranks)]
        result = self.runner(
            [*self.systemctl, "show", *units, f"--property={_PROPERTIES}", "--timestamp=unix"]
        )
        if result.returncode != 0:
            reason = (result.stderr or result.stdout).strip() or f"exit code {result.returncode}"
            return [RankStatus(0, "unknown", detail=f"systemctl show failed: {reason}")]
        blocks = [_properties(block) for block in result.stdout.split("\n\n") if block.strip()]
        by_unit = {block.get("Id", "").removesuffix(".service"): block for block in blocks}
        statuses = []
        for rank, unit in enumerate(units):
            block = by_unit.get(unit.removesuffix(".service"))
            if block is None and rank < len(blocks) and "Id" not in blocks[rank]:
                block = blocks[rank]  # an old systemctl that leaves Id out: blocks keep order
            if block is None or block.get("LoadState") == "not-found":
                if rank == 0:
                    statuses.append(RankStatus(0, "unknown", detail=f"{unit} is not installed"))
                continue
            statuses.append(_rank_status(rank, block))
        return statuses

    def log_runs(self, rank: int) -> list[LogRun]:
        """The unit's latest invocations, newest first, from systemd's (PID 1's) messages about
        it; [] when the journal cannot be read."""
        unit = self.unit_name(rank)
        service = unit if "." in unit.rpartition("@")[2] else f"{unit}.service"
        result = self.runner(
            [
                *self.journalctl,
                "_PID=1",
                f"UNIT={service}",
                "-n",
                str(_MANAGER_MESSAGES),
                "--no-pager",
                "-o",
                "json",
                "--output-fields=INVOCATION_ID",
            ]
        )
        if result.returncode != 0:
            return []
        started = _invocation_starts(result.stdout)
        newest = sorted(started, key=lambda ident: started[ident], reverse=True)[:MAX_RUNS]
        return [
            LogRun(ident, started[ident], is_current=index == 0)
            for index, ident in enumerate(newest)
        ]

    def log_tail(self, rank: int, lines: int, run: str | None = None) -> str:
        """By default the unit's latest lines, whichever runs wrote them (after a failed start
        the failure and systemd's restart of it read on); a run: the lines of its processes and
        systemd's messages about it."""
        matches: list[str] = []
        if run is not None:
            if not _INVOCATION_ID.fullmatch(run) or run not in {
                listed.id for listed in self.log_runs(rank)
            }:
                return ""
            matches = [f"_SYSTEMD_INVOCATION_ID={run}", "+", f"INVOCATION_ID={run}"]
        result = self.runner(
            [
                *self.journalctl,
                "-u",
                self.unit_name(rank),
                "-n",
                str(max(1, lines)),
                "--no-pager",
                "-o",
                "short-iso",
                *matches,
            ]
        )
        text = result.stdout if result.returncode == 0 else result.stderr or result.stdout
        return tail_lines(text.rstrip("\n"), lines)


def _invocation_starts(journal_json: str) -> dict[str, float]:
    """Each invocation id in `journalctl -o json` lines, with its earliest entry's time."""
    started: dict[str, float] = {}
    for line in journal_json.splitlines():
        try:
            entry = json.loads(line)
            ident, micros = entry.get("INVOCATION_ID"), int(entry["__REALTIME_TIMESTAMP"])
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
        if isinstance(ident, str) and _INVOCATION_ID.fullmatch(ident):
            seconds = micros / 1e6
            started[ident] = min(seconds, started.get(ident, seconds))
    return started


def _properties(block: str) -> dict[str, str]:
    pairs = (line.partition("=") for line in block.splitlines() if "=" in line)
    return {key.strip(): value.strip() for key, _, value in pairs}


def _timestamp(value: str) -> float | None:
    """`@1700000000` (--timestamp=unix); None for an empty or unparsable value."""
    if value.startswith("@"):
        try:
            return float(value[1:])
        except ValueError:
            return None
    return None


def _rank_status(rank: int, block: dict[str, str]) -> RankStatus:
    active = block.get("ActiveState", "unknown")
    state = _STATES.get(active, active)
    if active == "activating" and block.get("SubState") == "auto-restart":
        state = "restarting"
    pid_text = block.get("MainPID", "0")
    pid = int(pid_text) if pid_text.isdigit() and int(pid_text) > 0 else None
    detail = f"{active}/{block.get('SubState', '?')}"
    if state in ("failed", "restarting", "stopped") and block.get("ExecMainStatus", "0") != "0":
        detail += f", last exit code {block['ExecMainStatus']}"
    started = _timestamp(block.get("ExecMainStartTimestamp", "")) if pid is not None else None
    return RankStatus(rank, state, pid=pid, started_at=started, detail=detail)
