"""Environment overrides of the runtime's deadlines, for operators who tuned them in the engine
dgpp replaces. Read by the CLI only; the engine gets plain `WorldTimeouts`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from dgpp.engine.distributed.world_spec import WorldTimeouts
from dgpp.engine.errors import ConfigError

# variable -> (WorldTimeouts field, seconds per unit of the variable)
ENV_OVERRIDES: dict[str, tuple[str, float]] = {
    "DGPP_BOUNDARY_TIMEOUT_MS": ("collective_s", 1e-3),
    "DGPP_CONSUMER_DEADLINE_S": ("control_deadline_s", 1.0),
    "DGPP_BUS_COMPLETION_TIMEOUT_MS": ("step_watchdog_s", 1e-3),
}


def apply_env_overrides(timeouts: WorldTimeouts, environ: Mapping[str, str]) -> WorldTimeouts:
    """`timeouts` with every variable of `ENV_OVERRIDES` that `environ` sets applied."""
    changes: dict[str, float] = {}
    for name, (field, unit) in ENV_OVERRIDES.items():
        text = environ.get(name)
        if text is None or not text.strip():
            continue
        try:
            value = float(text) * unit
        except ValueError:
            raise ConfigError(f"{name} must be a number, got {text!r}") from None
        if not value > 0:
            raise ConfigError(f"{name} must be positive, got {text!r}")
        changes[field] = value
    return replace(timeouts, **changes)
