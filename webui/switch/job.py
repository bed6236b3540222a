"""A switch as the console records it: who asked for what, the phases it went through, how it
ended and why, and the deployment file it applied beside the one it replaced.

Jobs are immutable: the switcher replaces a job by an updated copy at every step, and the switch
log stores each copy, so the record is as far along as the switch was."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from dgpp.appliance.deployments.diff import Change


class Phase(enum.StrEnum):
    DRAINING = "draining"
    WRITING = "writing"
    RELOADING = "reloading"  # only live knobs changed: rank 0 takes them without a restart
    RESTARTING = "restarting"
    WAITING = "waiting"
    READY = "ready"
    ROLLING_BACK = "rolling back"
    ROLLED_BACK = "rolled back"
    FAILED = "failed"


FINAL = frozenset({Phase.READY, Phase.ROLLED_BACK, Phase.FAILED})


@dataclass(frozen=True)
class Step:
    at: float  # wall clock
    phase: Phase
    message: str


@dataclass(frozen=True)
class ChangeRecord:
    """One changed key as the operator confirmed it in the preview. A record keeps the texts
    shown, not the values: they read back from storage exactly as they were shown."""

    path: str  # "engine.kv_capacity"
    old_text: str
    new_text: str

    @classmethod
    def of(cls, change: Change) -> ChangeRecord:
        return cls(change.path, change.old_text, change.new_text)


@dataclass(frozen=True)
class SwitchJob:
    ident: int
    title: str
    changes: tuple[ChangeRecord, ...]
    started_at: float
    who: str = ""  # the logged-in user who applied it
    phase: Phase = Phase.DRAINING
    steps: tuple[Step, ...] = ()
    reason: str | None = None  # why the new deployment was not kept
    log_tail: str = ""  # rank 0's log when it failed
    finished_at: float | None = None
    applied: str = ""  # the deployment file's content this switch wrote
    replaced: str = ""  # the content it replaced (written back by a rollback)

    @property
    def is_final(self) -> bool:
        return self.phase in FINAL

    @property
    def duration_s(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.started_at

    def as_json(self) -> dict[str, Any]:
        """The job without the deployment files (polled every second while it runs)."""
        return {
            "id": self.ident,
            "title": self.title,
            "who": self.who,
            "phase": str(self.phase),
            "final": self.is_final,
            "changes": [
                {"path": c.path, "old": c.old_text, "new": c.new_text} for c in self.changes
            ],
            "steps": [
                {"at": s.at, "phase": str(s.phase), "message": s.message} for s in self.steps
            ],
            "reason": self.reason,
            "log_tail": self.log_tail,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "duration_s": self.duration_s,
        }
