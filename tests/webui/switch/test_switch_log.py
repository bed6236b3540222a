"""The switch log: a job reads back exactly as it was saved, each save replaces the row, ids go
on after a reopen, unfinished jobs are found, old rows are pruned, and a disk that refuses a
record does not stop the switch that writes it."""

from __future__ import annotations

import logging
import sqlite3
from dataclasses import replace
from pathlib import Path

import pytest

from dgpp.webui.switch.job import ChangeRecord, Phase, Step, SwitchJob
from dgpp.webui.switch.log import SwitchLog


def _job(ident: int, phase: Phase = Phase.READY) -> SwitchJob:
    return SwitchJob(
        ident,
        f"switch {ident}",
        (ChangeRecord("engine.kv_capacity", "2048", "4096"), ChangeRecord("x", "(absent)", "1")),
        1000.0 + ident,
        who="admin",
        phase=phase,
        steps=(Step(1000.5 + ident, Phase.DRAINING, "stopping admission"), Step(1001.0, phase, "")),
        reason="rank 0 failed: ConfigError: no" if phase is Phase.ROLLED_BACK else None,
        log_tail="rank0 ERROR dgpp.head: cannot serve: ConfigError: no",
        finished_at=1010.0 + ident if phase in (Phase.READY, Phase.ROLLED_BACK) else None,
        applied='{\n  "model": "b"\n}\n',
        replaced='{\n  "model": "a"\n}\n',
    )


def test_a_job_reads_back_as_saved_and_a_save_replaces_its_row(tmp_path: Path) -> None:
    journal = SwitchLog(tmp_path / "switches.sqlite")
    running = _job(1, Phase.WAITING)
    journal.save(running)
    assert journal.get(1) == running
    done = replace(running, phase=Phase.ROLLED_BACK, finished_at=1020.0, reason="why")
    journal.save(done)
    assert journal.get(1) == done
    assert journal.get(1).duration_s == pytest.approx(19.0)
    assert journal.get(2) is None
    assert journal.recent(10) == [done]


def test_a_reopened_log_has_the_jobs_and_the_last_id(tmp_path: Path) -> None:
    path = tmp_path / "switches.sqlite"
    journal = SwitchLog(path)
    assert journal.last_ident() == 0
    for ident in (1, 2, 3):
        journal.save(_job(ident, Phase.WAITING if ident == 3 else Phase.READY))
    journal.close()
    with sqlite3.connect(path) as db:  # readers never wait for the console's writes
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    reopened = SwitchLog(path)
    assert reopened.last_ident() == 3
    assert [job.ident for job in reopened.recent(2)] == [3, 2]
    assert [job.ident for job in reopened.unfinished()] == [3]


def test_the_oldest_rows_beyond_keep_are_pruned(tmp_path: Path) -> None:
    journal = SwitchLog(tmp_path / "switches.sqlite", keep=3)
    for ident in range(1, 7):
        journal.save(_job(ident))
    assert [job.ident for job in journal.recent(10)] == [6, 5, 4]
    assert journal.last_ident() == 6


def test_a_record_that_cannot_be_written_is_logged_not_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    journal = SwitchLog(tmp_path / "switches.sqlite")
    journal.close()
    with caplog.at_level(logging.WARNING, logger="dgpp.webui.switch.log"):
        journal.save(_job(1))
    assert "cannot record switch 1" in caplog.text
