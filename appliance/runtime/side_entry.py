"""One side model's record in `side_supervisor`: its process and state, what it has done, what it
holds, and the deployment its own `dgpp serve` runs."""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from dgpp.appliance.deployments.side_models import SideModel
from dgpp.appliance.deployments.side_plan import side_cost

GIB = 1 << 30
LOG_TAIL_CHARS = 600


@dataclass
class SideEntry:
    side: SideModel
    socket: Path
    models_dir: str | None = None  # the deployment's `paths.models_dir`, searched first
    state: str = "unloaded"  # unloaded, loading, loaded, failed
    process: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    in_flight: int = 0
    last_used: float = 0.0  # time.monotonic()
    load_started: float = 0.0
    load_seconds: float | None = None
    failed_at: float = 0.0
    error: str | None = None
    loads: int = 0
    unloads: int = 0
    crashes: int = 0
    planned_bytes: int | None = field(default=None, repr=False)
    spawn_pending: bool = False  # loading: its server starts once the memory it needs is free

    @property
    def is_idle(self) -> bool:
        return self.state == "loaded" and self.in_flight == 0

    @property
    def idle_for(self) -> float:
        return time.monotonic() - self.last_used if self.in_flight == 0 else 0.0

    def memory(self) -> int:
        """The bytes it may take: `memory_gib`, else its engine's memory plan (0 when the plan
        cannot be made: the load itself will say why)."""
        if self.side.memory_gib is not None:
            return int(self.side.memory_gib * GIB)
        if self.planned_bytes is None:
            self.planned_bytes = side_cost(self.side, self.models_dir).bytes or 0
        return self.planned_bytes

    def fail(self, why: str) -> None:
        self.state, self.failed_at = "failed", time.monotonic()
        tail = self.log_tail()
        self.error = f"{why}; its log ends: {tail}" if tail else why

    def log_tail(self) -> str:
        if self.log_path is None or not self.log_path.is_file():
            return ""
        text = self.log_path.read_text(errors="replace").strip()
        return " ".join(text[-LOG_TAIL_CHARS:].split())

    def healthy(self) -> bool:
        if not self.socket.exists():
            return False
        try:
            with httpx.Client(transport=httpx.HTTPTransport(uds=str(self.socket))) as client:
                return client.get("http://side/health", timeout=0.5).status_code == 200
        except httpx.HTTPError:
            return False

    def card(self) -> dict[str, Any]:
        """Its /v1/models entry (OpenAI's fields, then dgpp's)."""
        now = time.monotonic()
        return {
            "id": self.side.name,
            "object": "model",
            "created": 0,
            "owned_by": "dgpp",
            "root": self.side.model,
            "kind": self.side.kind,
            "state": self.state,
            "aliases": list(self.side.aliases),
            "load": self.side.load,
            "memory_bytes": self.memory(),
            "in_flight": self.in_flight,
            "pid": self.process.pid if self.process is not None else None,
            "idle_s": round(now - self.last_used, 1) if self.last_used else None,
            "load_s": None if self.load_seconds is None else round(self.load_seconds, 2),
            "loads": self.loads,
            "unloads": self.unloads,
            "crashes": self.crashes,
            "error": self.error,
        }


def side_deployment(side: SideModel, socket: Path, common: dict[str, Any]) -> dict[str, Any]:
    """The deployment a side model's own `dgpp serve` runs: its model and engine knobs, its
    names, the socket; plus the main deployment's `common` sections (paths, resident cache)."""
    engine = side.engine.model_dump(exclude_unset=True)
    return {
        **common,
        "model": side.model,
        "engine": {**engine, "kind": side.kind},
        "http": {"uds": str(socket), "served_model_names": [side.name, *side.aliases]},
    }
