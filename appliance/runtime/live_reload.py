"""Live knobs: a running rank 0 takes a new deployment without a restart when every key that
changed is a knob declared `live` (`knob(..., live=True)`: read only by rank 0's scheduler or
HTTP server, never by the other ranks and never to size memory).

A reload (SIGHUP, so `systemctl reload dgpp@rank0`; or `POST /admin/reload`, which the console
uses) reads the deployment again the way the rank was started (its file, with the command line's
flags over it), compares it with the running one key by key (`deployments.diff`), and applies
every change or none: a change to any other key (the model, the KV pool, a timeout) needs a
restart, and the refusal names those keys. Applied knobs hold from the engine's next step (the
requests in flight included), survive a re-formed world, and are the running deployment a
later reload compares with.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

from dgpp.appliance.deployments.deployment import Deployment, engine_config, server_config
from dgpp.appliance.deployments.diff import Change, diff
from dgpp.engine.configuration.engine_config import EngineConfig
from dgpp.engine.configuration.knobs import knobs_of
from dgpp.engine.distributed.world_spec import WorldTimeouts
from dgpp.engine.errors import DgppError
from dgpp.engine.server.core.config import ServerConfig

log = logging.getLogger("dgpp.reload")

RETUNE_TIMEOUT_S = 30.0  # the engine takes new knobs between two steps


@functools.cache
def live_keys() -> frozenset[str]:
    """The deployment keys of every live knob ("engine.step_target_ms", "http.queue_limit")."""
    return frozenset(
        each.deployment
        for cls in (EngineConfig, ServerConfig, WorldTimeouts)
        for each in knobs_of(cls)
        if each.live and each.deployment
    )


class RestartRequiredError(DgppError):
    """The new deployment changes keys a running rank 0 cannot take: a restart (the console's
    switch) applies it."""

    code = "restart_required"


class NothingToReloadError(DgppError):
    """This rank 0 reads no deployment file (`dgpp serve` with flags only)."""

    code = "nothing_to_reload"


def live_changes(running: Deployment, new: Deployment) -> list[Change]:
    """The changes from `running` to `new`, all of them live; `RestartRequiredError` naming
    every key that is not."""
    changes = diff(running, new)
    keys = live_keys()
    fixed = [change for change in changes if change.path not in keys]
    if fixed:
        named = ", ".join(f"{c.path} ({c.old_text} -> {c.new_text})" for c in fixed)
        raise RestartRequiredError(
            f"these changes need a restart of rank 0 (the console's switch): {named}; "
            f"live knobs are {', '.join(sorted(keys))}"
        )
    return changes


def _values(source: Any, cls: type, paths: set[str]) -> dict[str, Any]:
    """The values `source` (a `cls`) has for its knobs at the deployment keys `paths`."""
    return {e.name: getattr(source, e.name) for e in knobs_of(cls) if e.deployment in paths}


# Hands a reload's deployment and the changed knobs' values (the engine's, the HTTP server's,
# by knob name) to the running process.
Apply = Callable[[Deployment, dict[str, Any], dict[str, Any]], None]


class LiveReloader:
    """Reloads one rank 0 running `deployment`: `source` reads its deployment again, `apply`
    hands the changed knobs to the running parts. One reload at a time."""

    def __init__(
        self,
        deployment: Deployment,
        source: Callable[[], Deployment] | None,
        apply: Apply,
        api_key: str | None = None,
    ) -> None:
        self.deployment = deployment  # what a reload compares with
        self.source = source
        self.apply = apply
        self.api_key = api_key  # --api-key, which wins over the file's key (as at start)
        self._lock = threading.Lock()

    def reload(self) -> dict[str, list[Any]]:
        """Read the deployment again and apply it: every changed key -> [old, new] (empty when
        nothing changed). `NothingToReloadError`, `ConfigError` (an invalid file: nothing is
        applied) or `RestartRequiredError`."""
        if self.source is None:
            raise NothingToReloadError(
                "this rank 0 reads no deployment file (started with flags only): restart it "
                "with other flags instead"
            )
        with self._lock:
            new = self.source()
            changes = live_changes(self.deployment, new)
            if changes:
                paths = {change.path for change in changes}
                engine = _values(engine_config(new), EngineConfig, paths)
                server = _values(server_config(new, self.api_key), ServerConfig, paths)
                self.apply(new, engine, server)
            self.deployment = new
        return {change.path: [change.old, change.new] for change in changes}

    def reload_logged(self) -> None:
        """`reload`, its outcome logged (SIGHUP has no one to answer)."""
        try:
            applied = self.reload()
        except DgppError as err:
            log.error("reload refused, nothing changed: %s", err)
            return
        except Exception:  # a reload must never take rank 0 down
            log.exception("reload failed")
            return
        if applied:
            log.info(
                "reloaded live: %s",
                ", ".join(f"{path} {old!r} -> {new!r}" for path, (old, new) in applied.items()),
            )
        else:
            log.info("reloaded: the deployment is unchanged")
