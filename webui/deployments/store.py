"""The deployment file the console manages: read it, resolve it the way rank 0 will, and replace
it atomically, keeping earlier versions beside the console's state for the operator."""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dgpp.appliance.common.json_file import read_object
from dgpp.appliance.deployments.deployment import Deployment, default_served_name, parse_deployment
from dgpp.appliance.deployments.files import expand_template
from dgpp.appliance.deployments.http_keys import read_key_file
from dgpp.engine.errors import ConfigError

_ANY_ADDRESS = ("", "0.0.0.0", "::", "[::]")
# The name `_back_up` gives a kept file, without `.json`: the only names `read_kept` opens.
_KEPT_NAME = re.compile(r"deployment-\d{8}-\d{6}-\d{9}")


def deployment_text(raw: dict[str, Any]) -> str:
    """A deployment file's content as the console writes it."""
    return json.dumps(raw, indent=2) + "\n"


@dataclass(frozen=True)
class KeptDeployment:
    """An earlier deployment file, kept when a write replaced it."""

    name: str  # "deployment-20261202-041834-123456789"
    replaced_at: float  # when it was replaced (wall clock)


@dataclass(frozen=True)
class EngineTarget:
    """Where rank 0's HTTP server answers, the API key it wants and the key of its `/admin/*`
    routes (None: no key; the admin routes then answer loopback clients only)."""

    url: str
    api_key: str | None
    admin_key: str | None = None

    def __repr__(self) -> str:  # the keys stay out of logs
        return (
            f"EngineTarget(url={self.url!r}, api_key={'set' if self.api_key else None}, "
            f"admin_key={'set' if self.admin_key else None})"
        )

    def headers(self, path: str) -> dict[str, str]:
        """The authorization `path` needs: the admin key for `/admin/*`, else the API key."""
        key = self.admin_key if path.startswith("/admin/") else self.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}


def resolve_raw(raw: dict[str, Any], source: str = "the deployment") -> Deployment:
    """The deployment rank 0 will run for this file content (its template filled in)."""
    return parse_deployment(expand_template(raw), source)


def served_names(deployment: Deployment) -> tuple[str, ...]:
    names = tuple(deployment.http.served_model_names)
    return names or (default_served_name(deployment.model),)


def engine_target(deployment: Deployment, url: str | None = None) -> EngineTarget:
    http = deployment.http
    if url is None:
        host = "127.0.0.1" if http.host in _ANY_ADDRESS else http.host
        host = f"[{host}]" if ":" in host and not host.startswith("[") else host
        url = f"http://{host}:{http.port}"
    return EngineTarget(
        url.rstrip("/"),
        _key(http.api_key_file, "http.api_key_file"),
        _key(http.admin_key_file, "http.admin_key_file"),
    )


def _key(path: str | None, setting: str) -> str | None:
    if not path:
        return None
    try:
        return read_key_file(path, setting)
    except ConfigError:
        return None  # the engine answers 401 (or refused to start), which the console shows


class DeploymentStore:
    def __init__(self, path: Path, backups_dir: Path, keep: int = 20) -> None:
        self.path = path
        self.backups_dir = backups_dir
        self.keep = keep

    def read_raw(self) -> dict[str, Any]:
        return read_object(self.path, "the deployment")

    def current(self) -> Deployment:
        return resolve_raw(self.read_raw(), str(self.path))

    def write(self, raw: dict[str, Any]) -> None:
        """Replace the file with `raw` (after keeping the present one under `backups_dir`).
        The new file keeps the old one's mode and group: the ranks read it through group dgpp,
        which is not the console user's own group."""
        text = deployment_text(raw)
        old = self.path.stat() if self.path.exists() else None
        if old is not None:
            self._back_up()
        mode = old.st_mode & 0o777 if old is not None else 0o644
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        try:
            with os.fdopen(fd, "w") as handle:
                if old is not None and old.st_gid != os.getegid():
                    os.fchown(handle.fileno(), -1, old.st_gid)
                os.fchmod(handle.fileno(), mode)  # whatever the umask took away
                handle.write(text)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, self.path)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise

    def kept(self) -> list[KeptDeployment]:
        """The earlier files kept under `backups_dir`, newest first."""
        found = []
        for path in self.backups_dir.glob("deployment-*.json"):
            if _KEPT_NAME.fullmatch(path.stem):
                try:
                    found.append(KeptDeployment(path.stem, path.stat().st_mtime))
                except FileNotFoundError:  # pruned meanwhile
                    continue
        return sorted(found, key=lambda kept: kept.name, reverse=True)

    def read_kept(self, name: str) -> str | None:
        """The content of the kept file `name` (see `kept`); None for a name it does not
        list, or a file pruned since."""
        if not _KEPT_NAME.fullmatch(name):
            return None
        try:
            return (self.backups_dir / f"{name}.json").read_text()
        except FileNotFoundError:
            return None

    def _back_up(self) -> None:
        self.backups_dir.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        target = self.backups_dir / f"deployment-{stamp}-{time.time_ns() % 10**9:09d}.json"
        target.write_bytes(self.path.read_bytes())
        backups = sorted(self.backups_dir.glob("deployment-*.json"))
        for old in backups[: max(0, len(backups) - self.keep)]:
            old.unlink(missing_ok=True)
