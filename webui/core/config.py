"""The console's settings: one frozen object, from an optional JSON file and the command line.

Unknown keys and wrong types are refused with the key's name, like the deployment file."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dgpp.appliance.common.json_file import read_object
from dgpp.engine.errors import ConfigError

SYSTEM_DEPLOYMENT = Path("/etc/dgpp/deployment.json")
SYSTEM_CREDENTIALS = Path("/etc/dgpp/webui.credentials")


class ConsoleConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    deployment: Path  # the deployment file rank 0 starts from; the console rewrites it
    backend: Literal["systemd", "local"] = "local"
    state_dir: Path  # history.sqlite, earlier deployments, rank 0's output (local backend)
    credentials: Path
    host: str = "127.0.0.1"
    port: int = Field(18090, ge=1, le=65535)
    # The engine's base URL; by default from the deployment (http.host, http.port). With the
    # local backend it must reach that address (webui/core/engine_address.py).
    engine_url: str | None = None
    systemctl: tuple[str, ...] = ("systemctl",)  # e.g. ("sudo", "-n", "systemctl")
    # Local backend: start the engine with the console, stop it after (--no-autostart: off).
    autostart: bool = True
    sample_interval_s: float = Field(2.0, ge=0.0)  # 0: no sampler (tests)
    # Compute every Models row's memory plan in the background when the console starts.
    warm_plans: bool = True
    history_retention_s: float = Field(7 * 86400.0, gt=0)
    history_max_rows: int = Field(500_000, ge=100)
    drain_timeout_s: float = Field(60.0, ge=0.0)
    ready_timeout_s: float = Field(900.0, gt=0)
    poll_interval_s: float = Field(1.0, gt=0)
    session_ttl_s: float = Field(12 * 3600.0, gt=0)
    login_max_failures: int = Field(5, ge=1)
    login_window_s: float = Field(300.0, gt=0)
    secure_cookie: bool = False  # set when a TLS proxy fronts the console
    # Warn when a busy GPU's SM clock is under this fraction of its target clock.
    clock_warning_fraction: float = Field(0.7, gt=0.0, le=1.0)
    engine_timeout_s: float = Field(5.0, gt=0)  # one HTTP call to the engine


def load_console_config(path: Path | None, overrides: dict[str, Any]) -> ConsoleConfig:
    """The file's settings (if any) with `overrides` (command-line flags) on top."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = read_object(path, "the console settings")
    raw.update({key: value for key, value in overrides.items() if value is not None})
    return parse_console_config(raw, str(path) if path is not None else "the command line")


def parse_console_config(raw: dict[str, Any], source: str = "console settings") -> ConsoleConfig:
    raw = dict(raw)
    backend = raw.setdefault("backend", "systemd" if SYSTEM_DEPLOYMENT.exists() else "local")
    state_dir = Path(raw.get("state_dir") or _default_state_dir())
    raw["state_dir"] = state_dir
    if not raw.get("deployment"):
        raw["deployment"] = (
            SYSTEM_DEPLOYMENT if backend == "systemd" else state_dir / "deployment.json"
        )
    if not raw.get("credentials"):
        raw["credentials"] = (
            SYSTEM_CREDENTIALS if backend == "systemd" else state_dir / "webui.credentials"
        )
    try:
        return ConsoleConfig.model_validate(raw)
    except ValidationError as err:
        problems = [
            f"{'.'.join(str(part) for part in error['loc'])}: {error['msg']}"
            for error in err.errors()
        ]
        raise ConfigError(f"{source} is invalid: " + "; ".join(problems)) from None


def _default_state_dir() -> Path:
    from dgpp.appliance.common.paths import data_dir

    return data_dir() / "webui"
