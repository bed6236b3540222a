"""Every switch the console ran, in SQLite beside its other state (`switches.sqlite`): one row
per switch, rewritten at each of its steps, so a console that dies mid-switch leaves a record
as far along as the switch was. The oldest rows beyond `keep` are deleted as new ones arrive.

A record that cannot be written is logged and skipped: the switch itself must go on (stopping
it halfway would leave the engine drained)."""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
from pathlib import Path
from typing import Any

from dgpp.webui.switch.job import FINAL, ChangeRecord, Phase, Step, SwitchJob

log = logging.getLogger(__name__)
SQLITE_INTEGER_LIMIT = 1 << 63  # an INTEGER column holds signed 64-bit values

_SCHEMA = """
CREATE TABLE IF NOT EXISTS switches (
    id INTEGER PRIMARY KEY,
    who TEXT NOT NULL,
    title TEXT NOT NULL,
    started_at REAL NOT NULL,
    finished_at REAL,
    duration_s REAL,
    phase TEXT NOT NULL,
    reason TEXT,
    changes TEXT NOT NULL,  -- JSON: [{"path", "old", "new"}], the texts the preview showed
    steps TEXT NOT NULL,  -- JSON: [{"at", "phase", "message"}]
    log_tail TEXT NOT NULL,  -- rank 0's log when the new deployment failed
    applied TEXT NOT NULL,  -- the deployment file's content written
    replaced TEXT NOT NULL  -- the content it replaced
)
"""
_COLUMNS = (
    "id, who, title, started_at, finished_at, duration_s, phase, reason, changes, steps, "
    "log_tail, applied, replaced"
)


class SwitchLog:
    def __init__(self, path: Path, keep: int = 1000) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.keep = keep
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def save(self, job: SwitchJob) -> None:
        """Insert or replace `job`'s row (logged, not raised, when the disk refuses)."""
        shown = job.as_json()  # changes and steps as the API shows them
        row = (
            job.ident,
            job.who,
            job.title,
            job.started_at,
            job.finished_at,
            job.duration_s,
            str(job.phase),
            job.reason,
            json.dumps(shown["changes"]),
            json.dumps(shown["steps"]),
            job.log_tail,
            job.applied,
            job.replaced,
        )
        marks = ", ".join("?" for _ in row)
        try:
            with self._lock:
                self._db.execute(
                    f"INSERT OR REPLACE INTO switches ({_COLUMNS}) VALUES ({marks})", row
                )
                self._db.execute(
                    "DELETE FROM switches WHERE id <= (SELECT id FROM switches ORDER BY id DESC "
                    "LIMIT 1 OFFSET ?)",
                    (self.keep,),
                )
        except sqlite3.Error as err:
            log.warning("cannot record switch %d in %s: %s", job.ident, self.path, err)

    def recent(self, limit: int) -> list[SwitchJob]:
        """The latest `limit` switches, newest first."""
        return self._select("ORDER BY id DESC LIMIT ?", (limit,))

    def get(self, ident: int) -> SwitchJob | None:
        if not 0 < ident < SQLITE_INTEGER_LIMIT:  # ids start at 1; SQLite cannot bind past this
            return None
        found = self._select("WHERE id = ?", (ident,))
        return found[0] if found else None

    def unfinished(self) -> list[SwitchJob]:
        """Switches not final: the console stopped while they ran."""
        marks = ", ".join("?" for _ in FINAL)
        return self._select(f"WHERE phase NOT IN ({marks}) ORDER BY id", tuple(map(str, FINAL)))

    def last_ident(self) -> int:
        """The highest id recorded (0 for none): ids go on from it, also after a restart."""
        with self._lock:
            return int(self._db.execute("SELECT COALESCE(MAX(id), 0) FROM switches").fetchone()[0])

    def _select(self, clause: str, parameters: tuple[Any, ...]) -> list[SwitchJob]:
        with self._lock:
            rows = self._db.execute(f"SELECT {_COLUMNS} FROM switches {clause}", parameters)
            return [_job(row) for row in rows.fetchall()]


def _job(row: tuple[Any, ...]) -> SwitchJob:
    ident, who, title, started_at, finished_at, _, phase, reason, changes, steps = row[:10]
    log_tail, applied, replaced = row[10:]
    return SwitchJob(
        ident=ident,
        title=title,
        changes=tuple(ChangeRecord(c["path"], c["old"], c["new"]) for c in json.loads(changes)),
        started_at=started_at,
        who=who,
        phase=Phase(phase),
        steps=tuple(Step(s["at"], Phase(s["phase"]), s["message"]) for s in json.loads(steps)),
        reason=reason,
        log_tail=log_tail,
        finished_at=finished_at,
        applied=applied,
        replaced=replaced,
    )
