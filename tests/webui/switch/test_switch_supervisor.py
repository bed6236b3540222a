"""The switch under a supervisor that restarts rank 0 by itself, as systemd does with the shipped
`dgpp@.service` (`Restart=always`, no start limit): a new rank 0 that cannot load exits and is
started again, so its unit goes `activating/auto-restart`, never `failed`. The switch must take
that for a failure and roll back at once, not after `ready_timeout_s`; but a `restarting` state
seen before the restart has taken effect is the old process's, not the new one's."""

from __future__ import annotations

from dgpp.appliance.control.backend import RankStatus
from dgpp.webui.routes.deps import get_backend
from tests.webui.conftest import DEPLOYMENT, Console
from tests.webui.fakes import BROKEN_MODEL, FakeBackend

CRASH_LOOP = "activating/auto-restart, last exit code 3"


def _supervised(console: Console, states: list[str]) -> list[str]:
    """After a restart into a broken deployment (or one serving `slow`) rank 0 answers nothing
    while the backend's status polls show `states` in turn: a broken one keeps showing the last
    of them, a slow one serves once they are used up. Returns the states shown, as they are."""
    world = console.world
    backend: FakeBackend = console.app.dependency_overrides[get_backend]()
    original_restart, original_status = world.restart, backend.status
    pending: list[str] = []
    shown: list[str] = []
    broken = [False]

    def restart() -> None:
        original_restart()
        if world.state == "failed" or world.model == "slow":
            broken[0] = world.state == "failed"
            pending[:] = states
            world.state = "down"

    def status() -> list[RankStatus]:
        if world.state == "down" and not pending:
            world.state = "serving"
        if world.state != "down":
            return original_status()
        state = pending[0] if broken[0] and len(pending) == 1 else pending.pop(0)
        shown.append(state)
        detail = CRASH_LOOP if state == "restarting" else "activating/start"
        return [RankStatus(0, state, detail=detail)]

    world.restart = restart  # type: ignore[method-assign]
    backend.status = status  # type: ignore[method-assign]
    return shown


def test_a_rank_0_the_supervisor_keeps_restarting_is_rolled_back_at_once(
    logged_in: Console,
) -> None:
    shown = _supervised(logged_in, ["running", "starting", "restarting"])
    before = logged_in.written()
    logged_in.apply({**DEPLOYMENT, "model": BROKEN_MODEL, "http": {}}, "Switch to broken")
    job = logged_in.wait_for_switch()
    assert job["phase"] == "rolled back", job
    assert job["reason"] == f"rank 0 exited and is restarting ({CRASH_LOOP})"
    assert shown == ["running", "starting", "restarting"]
    assert logged_in.world.actions == ["drain", "restart", "restart"]
    assert logged_in.written() == before
    assert logged_in.world.state == "serving" and logged_in.world.model == "m"


def test_a_restarting_state_from_before_the_restart_is_not_the_new_process(
    logged_in: Console,
) -> None:
    shown = _supervised(logged_in, ["restarting", "restarting", "starting"])
    # With a knob that needs a restart (served names alone are taken live: no restart).
    engine = {**DEPLOYMENT["engine"], "kv_capacity": 4096}
    logged_in.apply({**DEPLOYMENT, "engine": engine, "http": {"served_model_names": ["slow"]}})
    job = logged_in.wait_for_switch()
    assert job["phase"] == "ready", job
    assert shown == ["restarting", "restarting", "starting"]
    assert logged_in.world.actions == ["drain", "restart"]
