"""The worker processes that compute the Models page's memory plans in the background
(`plans.cache`): spawned, at the lowest CPU priority, each importing torch and the model families
before its first plan (seconds).

`dgpp webui` starts them before it imports the console itself (`start_early`), so their imports
run beside the console's own: a fresh console's page then finds them ready. A console whose
plans are all stored never takes them, and lets them go once it knows (`release_early`).
Only the standard library is imported here, so starting them costs the console nothing."""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.pool
import os

BACKGROUND_NICENESS = 19
WORKERS = min(2, os.cpu_count() or 1)  # background plans in parallel

_early: multiprocessing.pool.Pool | None = None


def lower_priority() -> None:
    with contextlib.suppress(AttributeError, OSError):
        os.nice(BACKGROUND_NICENESS)


def _prepare() -> None:
    """Every family's module and the planner: the first plan pays no import."""
    lower_priority()
    import dgpp.engine.models.registry
    import dgpp.webui.plans.memory_preview  # noqa: F401


def new_pool() -> multiprocessing.pool.Pool:
    return multiprocessing.get_context("spawn").Pool(WORKERS, initializer=_prepare)


def start_early() -> None:
    """Spawn the workers now (the console has not imported its modules yet)."""
    global _early
    if _early is None:
        _early = new_pool()


def take_early() -> multiprocessing.pool.Pool | None:
    """The workers `start_early` spawned, handed over once."""
    global _early
    pool, _early = _early, None
    return pool


def release_early() -> None:
    """Terminate the early workers if no plan took them."""
    pool = take_early()
    if pool is not None:
        pool.terminate()
