"""The systemd control backend, with the command runner replaced: what it would run, and how it
reads `systemctl show` and `journalctl`. Nothing here calls systemctl on this host."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from dgpp.appliance.control.systemd import CommandResult, SystemdBackend, run_command
from dgpp.webui.core.console import make_backend

SHOW = """Id=dgpp@rank0.service
LoadState=loaded
ActiveState=active
SubState=running
MainPID=4321
ExecMainStartTimestamp=@1700000000
ExecMainStatus=0

Id=dgpp@rank1.service
LoadState=loaded
ActiveState=activating
SubState=auto-restart
MainPID=0
ExecMainStartTimestamp=
ExecMainStatus=3

Id=dgpp@rank2.service
LoadState=not-found
ActiveState=inactive
SubState=dead
MainPID=0
ExecMainStartTimestamp=
ExecMainStatus=0

Id=dgpp@rank3.service
LoadState=not-found
ActiveState=inactive
SubState=dead
MainPID=0
ExecMainStartTimestamp=
ExecMainStatus=0
"""


class Runner:
    def __init__(self, answers: dict[str, CommandResult] | None = None) -> None:
        self.calls: list[list[str]] = []
        self.answers = answers or {}

    def __call__(self, argv: Sequence[str]) -> CommandResult:
        self.calls.append(list(argv))
        for word, answer in self.answers.items():
            if word in argv:
                return answer
        return CommandResult(0, "", "")


def _backend(runner: Runner, **options: object) -> SystemdBackend:
    return SystemdBackend(Path("/etc/dgpp/deployment.json"), runner=runner, **options)  # type: ignore[arg-type]


def test_restart_start_and_stop_drive_rank_0_only() -> None:
    runner = Runner()
    backend = _backend(runner, systemctl=("sudo", "-n", "systemctl"))
    assert backend.restart().ok and backend.start().ok and backend.stop().ok
    assert runner.calls == [
        ["sudo", "-n", "systemctl", "restart", "--no-block", "dgpp@rank0"],
        ["sudo", "-n", "systemctl", "start", "--no-block", "dgpp@rank0"],
        ["sudo", "-n", "systemctl", "stop", "dgpp@rank0"],
    ]


def test_a_refused_restart_says_why() -> None:
    runner = Runner({"restart": CommandResult(1, "", "Access denied\n")})
    result = _backend(runner).restart()
    assert not result.ok
    assert result.message == "systemctl restart --no-block dgpp@rank0 failed: Access denied"


def test_status_reads_every_installed_rank_unit() -> None:
    runner = Runner({"show": CommandResult(0, SHOW, "")})
    ranks = _backend(runner).status()
    assert runner.calls[0][:6] == [
        "systemctl",
        "show",
        "dgpp@rank0",
        "dgpp@rank1",
        "dgpp@rank2",
        "dgpp@rank3",
    ]
    assert "--timestamp=unix" in runner.calls[0]
    assert [(r.rank, r.state, r.pid, r.started_at) for r in ranks] == [
        (0, "running", 4321, 1700000000.0),
        (1, "restarting", None, None),
    ]
    assert ranks[1].detail == "activating/auto-restart, last exit code 3"


def test_status_when_systemctl_fails_or_the_unit_is_missing() -> None:
    failing = Runner({"show": CommandResult(1, "", "Failed to connect to bus")})
    (status,) = _backend(failing).status()
    assert (status.state, status.detail) == (
        "unknown",
        "systemctl show failed: Failed to connect to bus",
    )
    missing = SHOW.replace("LoadState=loaded", "LoadState=not-found")
    (status,) = _backend(Runner({"show": CommandResult(0, missing, "")})).status()
    assert (status.rank, status.state) == (0, "unknown")
    assert status.detail == "dgpp@rank0 is not installed"


def test_failed_unit_is_failed() -> None:
    failed = SHOW.replace("ActiveState=active", "ActiveState=failed").replace(
        "SubState=running", "SubState=failed"
    )
    ranks = _backend(Runner({"show": CommandResult(0, failed, "")})).status()
    assert ranks[0].state == "failed"


def test_log_tail_reads_the_journal() -> None:
    journal = "\n".join(f"line {n}" for n in range(10)) + "\n"
    runner = Runner({"journalctl": CommandResult(0, journal, "")})
    tail = _backend(runner).log_tail(2, 3)
    assert runner.calls == [
        ["journalctl", "-u", "dgpp@rank2", "-n", "3", "--no-pager", "-o", "short-iso"]
    ]
    assert tail == "line 7\nline 8\nline 9"


OLD, MIDDLE, NEW = "a" * 32, "b" * 32, "c" * 32


def _entry(invocation: str | None, seconds: float) -> str:
    """One line of `journalctl -o json --output-fields=INVOCATION_ID`, as systemd 252 prints it
    (the cursor, timestamps and boot id come whatever the fields asked for)."""
    entry = {
        "__CURSOR": f"s=1;i={int(seconds)}",
        "__REALTIME_TIMESTAMP": str(int(seconds * 1e6)),
        "__MONOTONIC_TIMESTAMP": "12345",
        "_BOOT_ID": "0" * 32,
    }
    if invocation is not None:
        entry["INVOCATION_ID"] = invocation
    return json.dumps(entry)


# systemd's messages about dgpp@rank0: starting, started, exited, scheduled restart, ... per run
MANAGER_JOURNAL = "\n".join(
    [
        _entry(OLD, 1700000100.5),  # a run's entries need not be in order (another boot's)
        _entry(OLD, 1700000000.25),
        _entry(MIDDLE, 1700000200.0),
        _entry(None, 1700000250.0),  # a message without an invocation
        "not json",
        _entry("not-an-id", 1700000260.0),
        _entry(MIDDLE, 1700000290.0),
        _entry(NEW, 1700000300.0),
    ]
)


def test_log_runs_are_the_units_invocations_newest_first() -> None:
    runner = Runner({"--output-fields=INVOCATION_ID": CommandResult(0, MANAGER_JOURNAL, "")})
    runs = _backend(runner).log_runs(0)
    assert runner.calls == [
        [
            "journalctl",
            "_PID=1",
            "UNIT=dgpp@rank0.service",
            "-n",
            "2000",
            "--no-pager",
            "-o",
            "json",
            "--output-fields=INVOCATION_ID",
        ]
    ]
    assert [(r.id, r.started_at, r.is_current) for r in runs] == [
        (NEW, 1700000300.0, True),
        (MIDDLE, 1700000200.0, False),
        (OLD, 1700000000.25, False),
    ]


def test_log_runs_keep_the_latest_ten_and_survive_an_unreadable_journal() -> None:
    many = "\n".join(_entry(f"{n:032x}", 1700000000.0 + n) for n in range(15))
    runs = _backend(Runner({"json": CommandResult(0, many, "")})).log_runs(1)
    assert [r.id for r in runs] == [f"{n:032x}" for n in range(14, 4, -1)]
    refused = Runner({"json": CommandResult(1, "", "No journal files were opened")})
    assert _backend(refused).log_runs(0) == []


def test_an_earlier_run_is_read_by_its_invocation() -> None:
    journal = "2026-12-01T10:00:00+0000 head dgpp[10]: rank0 INFO loading\n"
    runner = Runner(
        {
            "--output-fields=INVOCATION_ID": CommandResult(0, MANAGER_JOURNAL, ""),
            "short-iso": CommandResult(0, journal, ""),
        }
    )
    assert _backend(runner).log_tail(0, 50, run=MIDDLE) == journal.rstrip("\n")
    assert runner.calls[1] == [
        "journalctl",
        "-u",
        "dgpp@rank0",
        "-n",
        "50",
        "--no-pager",
        "-o",
        "short-iso",
        f"_SYSTEMD_INVOCATION_ID={MIDDLE}",
        "+",
        f"INVOCATION_ID={MIDDLE}",
    ]


def test_a_run_the_unit_never_had_reads_nothing() -> None:
    runner = Runner({"json": CommandResult(0, MANAGER_JOURNAL, "")})
    backend = _backend(runner)
    assert backend.log_tail(0, 50, run="d" * 32) == ""  # another unit's, or made up
    assert len(runner.calls) == 1  # the listing only
    assert backend.log_tail(0, 50, run="--merge") == ""
    assert len(runner.calls) == 1  # not even listed: no id looks like that


def test_the_settings_choose_the_backend(tmp_path: Path) -> None:
    assert make_backend("systemd", tmp_path / "d.json", tmp_path).kind == "systemd"
    assert make_backend("local", tmp_path / "d.json", tmp_path).kind == "local"


def test_a_missing_program_is_a_result_not_a_crash() -> None:
    result = run_command(["dgpp-no-such-program-here"])
    assert result.returncode == 127 and "not found" in result.stderr
