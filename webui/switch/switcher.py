"""The safe switch: every change the console makes (another model, other knobs) goes through it.

A change of live knobs only (`dgpp.appliance.runtime.live_reload`) is written and reloaded by rank
0 at once, without a restart; when rank 0 does not take it, the switch goes on as for any change:
validate -> drain (stop admitting; running requests finish, up to `drain_s`) -> write the new
deployment file -> restart rank 0 -> follow `/health` until the new server serves. When it does
not within `ready_s` (or rank 0 exits, or reports `failed`), the previous file is written back
and rank 0 restarted with it; the job then says why (rank 0's own last error line when its log
has one: `root_cause`), with rank 0's log tail.

One job at a time; jobs run as asyncio tasks and are read as snapshots while they run. Every
job is recorded in the switch log at its start, at each step and at its end, and written to the
console's log when it starts (who, what, the changed keys) and ends (outcome, duration, reason).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from dgpp.appliance.control.backend import ControlBackend
from dgpp.appliance.deployments.deployment import Deployment
from dgpp.appliance.deployments.diff import diff
from dgpp.appliance.runtime.live_reload import live_keys
from dgpp.webui.deployments.store import (
    DeploymentStore,
    deployment_text,
    resolve_raw,
    served_names,
)
from dgpp.webui.monitor.engine_client import EngineApi
from dgpp.webui.switch.job import ChangeRecord, Phase, Step, SwitchJob
from dgpp.webui.switch.log import SwitchLog
from dgpp.webui.switch.root_cause import root_cause

log = logging.getLogger(__name__)

EngineFactory = Callable[[Deployment], EngineApi]
UPTIME_SLACK_S = 2.0  # a serving rank 0 older than the restart (plus this) is the old one
LOG_TAIL_LINES = 80
HISTORY_JOBS = 20  # jobs kept in memory (the overview, /switch); the journal keeps more


class SwitchBusyError(Exception):
    """Another switch is still running."""


@dataclass(frozen=True)
class SwitchTimeouts:
    drain_s: float = 60.0
    ready_s: float = 900.0
    poll_s: float = 1.0


@dataclass(frozen=True)
class _Outcome:
    ok: bool
    reason: str = ""
    # Set when rank 0 itself failed: what happened ("rank 0 failed") and the supervisor's
    # detail ("exit code 3"). The reason then names the root cause from rank 0's log.
    failure: str = ""
    detail: str = ""

    def explained(self, log_tail: str) -> tuple[str, str]:
        """(the job's reason, the rolling-back step's message) once rank 0's log is read: the
        root-cause line when the log has one (the supervisor's detail stays in the step)."""
        cause = root_cause(log_tail) if self.failure else None
        if cause is None:
            return self.reason, self.reason
        return f"{self.failure}: {cause}", f"{self.failure} ({self.detail}): {cause}"


def _failure(what: str, detail: str) -> _Outcome:
    return _Outcome(False, f"{what} ({detail})", what, detail)


@dataclass
class Switcher:
    """Runs switches one at a time and keeps the latest ones; every change of a job is
    recorded in `journal` at once. Built on a journal, it resumes from it: the latest jobs are
    its history, ids go on, and a job the console stopped during is marked failed."""

    store: DeploymentStore
    journal: SwitchLog
    timeouts: SwitchTimeouts = field(default_factory=SwitchTimeouts)
    history: deque[SwitchJob] = field(default_factory=lambda: deque(maxlen=HISTORY_JOBS))
    _ids: itertools.count[int] = field(init=False)
    _task: asyncio.Task[None] | None = None

    def __post_init__(self) -> None:
        for job in self.journal.unfinished():
            stopped = _interrupted(job)
            self.journal.save(stopped)
            log.warning("switch %d failed: %s", job.ident, stopped.reason)
        self.history.extend(reversed(self.journal.recent(self.history.maxlen or HISTORY_JOBS)))
        self._ids = itertools.count(self.journal.last_ident() + 1)

    @property
    def latest(self) -> SwitchJob | None:
        return self.history[-1] if self.history else None

    def job(self, ident: int) -> SwitchJob | None:
        return next((job for job in self.history if job.ident == ident), None)

    @property
    def is_busy(self) -> bool:
        return self._task is not None and not self._task.done()

    def begin(
        self,
        title: str,
        new_raw: dict[str, Any],
        backend: ControlBackend,
        engine_for: EngineFactory,
        *,
        who: str,
    ) -> SwitchJob:
        """Start switching to `new_raw` for user `who` (already validated by the caller;
        checked again here). `SwitchBusyError` while another switch runs; `ConfigError` for an
        invalid deployment."""
        if self.is_busy:
            raise SwitchBusyError("another switch is still running")
        old_raw = self.store.read_raw()
        old, new = resolve_raw(old_raw), resolve_raw(new_raw, "the new deployment")
        changes = tuple(ChangeRecord.of(change) for change in diff(old, new))
        job = SwitchJob(
            next(self._ids),
            title,
            changes,
            time.time(),
            who=who,
            applied=deployment_text(new_raw),
            replaced=deployment_text(old_raw),
        )
        self.history.append(job)
        self.journal.save(job)
        log.info(
            "switch %d started by %s: %s; changes: %s",
            job.ident,
            who,
            title,
            ", ".join(change.path for change in changes) or "none",
        )
        self._task = asyncio.create_task(
            self._run(job.ident, old_raw, old, new_raw, new, backend, engine_for)
        )
        return job

    async def wait(self) -> SwitchJob | None:
        """The latest job, once it has finished."""
        if self._task is not None:
            await asyncio.shield(self._task)
        return self.latest

    def _step(self, ident: int, phase: Phase, message: str, **changes: Any) -> None:
        """Append a step (and apply `changes`) to job `ident`, and record it."""
        for index, job in enumerate(self.history):
            if job.ident == ident:
                step = Step(time.time(), phase, message)
                job = replace(job, phase=phase, steps=(*job.steps, step), **changes)
                self.history[index] = job
                self.journal.save(job)

    def _finish(self, ident: int, phase: Phase, message: str, **changes: Any) -> None:
        self._step(ident, phase, message, finished_at=time.time(), **changes)
        job = self.job(ident)
        assert job is not None and job.duration_s is not None
        level = logging.INFO if phase is Phase.READY else logging.WARNING
        log.log(
            level,
            "switch %d %s after %.1f s: %s",
            ident,
            phase,
            job.duration_s,
            job.reason or message,
        )

    async def _run(self, ident: int, *args: Any) -> None:
        try:
            await self._switch(ident, *args)
        except Exception as err:  # the job must end, whatever broke
            log.exception("switch %d failed", ident)
            reason = f"internal error: {type(err).__name__}: {err}"
            self._finish(ident, Phase.FAILED, reason, reason=reason)

    async def _switch(
        self,
        ident: int,
        old_raw: dict[str, Any],
        old: Deployment,
        new_raw: dict[str, Any],
        new: Deployment,
        backend: ControlBackend,
        engine_for: EngineFactory,
    ) -> None:
        old_engine = engine_for(old)
        changes, keys = diff(old, new), live_keys()
        live = bool(changes) and all(change.path in keys for change in changes)
        if live and await self._reload(ident, new_raw, old_engine):
            return
        await self._drain(ident, old_engine)
        self._step(ident, Phase.WRITING, f"writing {self.store.path}")
        try:
            await asyncio.to_thread(self.store.write, new_raw)
        except OSError as err:
            await old_engine.undrain()
            reason = f"cannot write {self.store.path}: {err}"
            self._finish(ident, Phase.FAILED, reason, reason=reason)
            return
        outcome = await self._start(ident, backend, engine_for(new), new)
        if outcome.ok:
            names = ", ".join(served_names(new))
            self._finish(ident, Phase.READY, f"serving {new.model} as {names}")
            return
        tail = await asyncio.to_thread(backend.log_tail, 0, LOG_TAIL_LINES)
        reason, message = outcome.explained(tail)
        self._step(
            ident,
            Phase.ROLLING_BACK,
            f"{message}; restoring the previous deployment",
            reason=reason,
            log_tail=tail,
        )
        await asyncio.to_thread(self.store.write, old_raw)
        restored = await self._start(ident, backend, engine_for(old), old)
        if restored.ok:
            self._finish(ident, Phase.ROLLED_BACK, f"back on {old.model}: {reason}")
        else:
            self._finish(
                ident,
                Phase.FAILED,
                f"the previous deployment did not come back either: {restored.reason}",
            )

    async def _reload(self, ident: int, new_raw: dict[str, Any], engine: EngineApi) -> bool:
        """Write the file and have rank 0 reload it; True once the job has ended (applied, or
        the file could not be written), False when rank 0 did not take it (the switch then
        restarts it as for any change)."""
        self._step(ident, Phase.WRITING, f"writing {self.store.path}")
        try:
            await asyncio.to_thread(self.store.write, new_raw)
        except OSError as err:
            reason = f"cannot write {self.store.path}: {err}"
            self._finish(ident, Phase.FAILED, reason, reason=reason)
            return True
        self._step(ident, Phase.RELOADING, "only live knobs changed: rank 0 reloads, no restart")
        ok, detail = await engine.reload()
        if ok:
            self._finish(ident, Phase.READY, f"applied live, no restart: {detail}")
            return True
        self._step(ident, Phase.RELOADING, f"rank 0 did not reload ({detail}); restarting it")
        return False

    async def _drain(self, ident: int, engine: EngineApi) -> None:
        self._step(ident, Phase.DRAINING, "stopping admission on the running engine")
        report = await engine.drain()
        if report is None:
            self._step(ident, Phase.DRAINING, "the engine took no drain request; restarting as is")
            return
        deadline = time.monotonic() + self.timeouts.drain_s
        left = _requests_left(report)
        while left and time.monotonic() < deadline:
            await asyncio.sleep(self.timeouts.poll_s)
            report = await engine.drain()
            left = _requests_left(report) if report is not None else 0
        if left:
            self._step(
                ident,
                Phase.DRAINING,
                f"{left} requests still running after {self.timeouts.drain_s:g} s; "
                "restarting anyway",
            )
        else:
            self._step(ident, Phase.DRAINING, "drained: no request running or waiting")

    async def _start(
        self, ident: int, backend: ControlBackend, engine: EngineApi, deployment: Deployment
    ) -> _Outcome:
        """Restart rank 0 and follow it until `deployment` serves, fails, or time runs out."""
        self._step(ident, Phase.RESTARTING, f"restarting rank 0 ({backend.kind})")
        before = (await engine.health()).body.get("instance")
        started = time.monotonic()
        result = await asyncio.to_thread(backend.restart)
        if not result.ok:
            return _Outcome(False, result.message)
        expected = served_names(deployment)[0]
        timeout = self.timeouts.ready_s
        self._step(ident, Phase.WAITING, f"waiting up to {timeout:g} s for /health")
        seen = ""
        # A supervisor that restarts rank 0 by itself (systemd's Restart=always) never shows it
        # `failed`: once rank 0 was seen in another state after the restart, `restarting` means
        # the new process exited. (Seen first, it can be the state from before the restart.)
        left_restarting = False
        while True:
            health = await engine.health()
            elapsed = time.monotonic() - started
            fresh = _is_new_process(health.body, before, elapsed)
            if health.is_serving and health.body.get("model") == expected and fresh:
                self._step(ident, Phase.WAITING, f"/health 200 after {elapsed:.1f} s")
                return _Outcome(True)
            if health.state != seen:
                seen = health.state
                self._step(ident, Phase.WAITING, f"{elapsed:.1f} s: {health.reason}")
            statuses = await asyncio.to_thread(backend.status)
            rank0 = next((status for status in statuses if status.rank == 0), None)
            if rank0 is not None and rank0.state == "failed":
                return _failure("rank 0 failed", rank0.detail)
            if rank0 is not None and rank0.state == "restarting" and left_restarting:
                return _failure("rank 0 exited and is restarting", rank0.detail)
            left_restarting = left_restarting or (rank0 is not None and rank0.state != "restarting")
            if health.status is not None and health.state == "failed":
                return _Outcome(False, f"rank 0 reports {health.reason}")
            if elapsed >= timeout:
                return _Outcome(False, f"not ready within {timeout:g} s ({health.reason})")
            await asyncio.sleep(self.timeouts.poll_s)


def _is_new_process(body: dict[str, Any], before: object, elapsed: float) -> bool:
    """Whether /health comes from the rank 0 started by this restart: its `instance` differs
    from the one seen before (engines that do not report one: by uptime, with some slack)."""
    instance = body.get("instance")
    if instance is not None and before is not None:
        return bool(instance != before)
    uptime = body.get("uptime_s")
    return isinstance(uptime, int | float) and uptime <= elapsed + UPTIME_SLACK_S


def _requests_left(report: dict[str, Any]) -> int:
    return int(report.get("running", 0)) + int(report.get("waiting", 0))


def _interrupted(job: SwitchJob) -> SwitchJob:
    """`job` as the console found it after a restart: failed where it stopped. Its end is its
    last recorded step (the console's downtime is no part of the switch)."""
    ended = job.steps[-1].at if job.steps else job.started_at
    reason = (
        f"the console stopped during this switch (while {job.phase}); the deployment file and "
        "rank 0 were left as they were then"
    )
    step = Step(ended, Phase.FAILED, reason)
    return replace(
        job, phase=Phase.FAILED, steps=(*job.steps, step), reason=reason, finished_at=ended
    )
