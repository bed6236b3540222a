"""Stand-ins for the engine and the control backend: a fake world whose rank 0 "restarts" by
reading the deployment file, and serves it unless its model is one the test marked broken."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dgpp.appliance.control.backend import ActionResult, LogRun, RankStatus
from dgpp.appliance.deployments.deployment import Deployment
from dgpp.appliance.runtime.live_reload import RestartRequiredError, live_changes
from dgpp.engine.server.metrics.prometheus import build_registry, render
from dgpp.engine.server.metrics.service import ServiceMetrics
from dgpp.webui.deployments.store import resolve_raw, served_names
from dgpp.webui.monitor.engine_client import Health

BROKEN_MODEL = "/models/cannot-load"

METRICS = {
    "scheduler": {
        "running": 1,
        "waiting": 0,
        "kv_blocks_total": 64,
        "kv_blocks_in_use": 4,
        "kv_block_size": 16,
        "kv_tokens_total": 1024,
        "tokens_generated": 100,
        "prompt_tokens_total": 400,
    },
    "memory": {
        "host_rss_bytes": 3 << 30,
        "device_allocated_bytes": 20 << 30,
        "device_reserved_bytes": 24 << 30,
        "device_total_bytes": 128 << 30,
    },
    "prefix_cache": {"hit_tokens": 100, "ttft_avg_hit_s": 0.05, "ttft_avg_miss_s": 0.4},
    "spec_decode": {
        "method": "off",
        "depth": 0,
        "drafts": 0,
        "drafted": 0,
        "accepted": 0,
        "acceptance_rate": None,
        "mean_accepted_length": None,
        "drafts_per_step": None,
        "per_position": [],
    },
}


# `/v1/metrics`'s self-check keys on a two-rank world where one kernel fell back (docs/metrics.md).
PTXAS_REASON = "compile: ptxas fatal: Value 'sm_121a' is not defined for option 'gpu-name'"
SELF_CHECK = {
    "kernels": {
        "paged_attention": f"fallback: {PTXAS_REASON}",
        "rms_norm": "ok",
        "cuda_graphs": "ok",
    },
    "kernel_checks": [
        {
            "kernel": "paged_attention",
            "label": "8 kv heads x 128, page 16",
            "dtype": "bfloat16",
            "seconds": 1.25,
            "error": None,
            "tolerance": 0.02,
            "failure": PTXAS_REASON,
        },
        {
            "kernel": "rms_norm",
            "label": "hidden 4096",
            "dtype": "bfloat16",
            "seconds": 0.0,
            "error": 0.0031,
            "tolerance": 0.02,
            "failure": "",
        },
    ],
    "allreduce": [
        {"bytes": 1 << 20, "seconds": 0.0002, "bus_gbps": 41.9},
        {"bytes": 64 << 20, "seconds": 0.0052, "bus_gbps": 103.2},
    ],
}


def node_snapshot(rank: int, hostname: str, **gpu: Any) -> dict[str, Any]:
    """One rank's entry of rank 0's `/admin/nodes`; with `gpu` fields, one GPU that has them."""
    report: dict[str, Any] = {"available": False, "reason": "unavailable: no driver", "gpus": []}
    if gpu:
        report = {"available": True, "reason": "", "gpus": [{"index": 0, "name": "GB10", **gpu}]}
    cpu = {"count": 20, "freq_mhz": 2800.0, "max_freq_mhz": 3900.0, "governor": "performance"}
    cpu |= {"load": [1.5, 1.25, 1.0], "utilisation_pct": 12.5}
    return {
        "rank": rank,
        "hostname": hostname,
        "time": time.time() - 2,
        "age_s": 2.0,
        "gpu": report,
        "cpu": cpu,
    }


@dataclass
class FakeWorld:
    """Rank 0 as the console sees it through both the backend and the engine API."""

    deployment_path: Path
    broken_models: set[str] = field(default_factory=lambda: {BROKEN_MODEL})
    starting_names: set[str] = field(default_factory=set)  # served names never ready after restart
    state: str = "serving"  # serving, failed, starting, down
    model: str = "m"
    started_at: float = field(default_factory=time.time)
    draining: bool = False
    running: int = 0
    actions: list[str] = field(default_factory=list)
    fail_restart: bool = False
    refuse_reload: bool = False  # an older rank 0, without POST /admin/reload
    speculative: tuple[str, int] = ("off", 0)  # what /v1/metrics reports: method, depth
    nodes: list[dict[str, Any]] = field(
        default_factory=lambda: [node_snapshot(0, "spark-1"), node_snapshot(1, "spark-2")]
    )
    # What `/v1/metrics` adds from the engine's start: `kernels`, `kernel_checks`, `allreduce`
    # (none: an engine older than the kernel self-check).
    self_check: dict[str, Any] = field(default_factory=dict)
    # The server's outcome counters and latency histograms (`/v1/metrics` service, `/metrics`);
    # tests record into it, and a restart starts it afresh as a real server's does.
    service: ServiceMetrics = field(default_factory=ServiceMetrics)

    def restart(self) -> None:
        deployment = resolve_raw(json.loads(self.deployment_path.read_text()))
        self.draining = False
        self.service = ServiceMetrics()
        self.started_at = time.time()
        self.model = served_names(deployment)[0]
        spec = deployment.speculative
        self.speculative = (spec.method, spec.depth if spec.method != "off" else 0)
        self.state = "failed" if deployment.model in self.broken_models else "serving"
        if self.state == "serving" and self.model in self.starting_names:
            self.state = "starting"


class FakeBackend:
    kind = "local"

    def __init__(self, world: FakeWorld) -> None:
        self.world = world

    @property
    def deployment_path(self) -> Path:
        return self.world.deployment_path

    def start(self) -> ActionResult:
        self.world.actions.append("start")
        return ActionResult(True, "started")

    def stop(self) -> ActionResult:
        self.world.actions.append("stop")
        return ActionResult(True, "stopped")

    def restart(self) -> ActionResult:
        self.world.actions.append("restart")
        if self.world.fail_restart:
            return ActionResult(False, "systemctl restart failed: access denied")
        self.world.restart()
        return ActionResult(True, "restarted")

    def status(self) -> list[RankStatus]:
        state = "failed" if self.world.state == "failed" else "running"
        return [RankStatus(0, state, pid=4242, started_at=self.world.started_at, detail="fake")]

    def log_runs(self, rank: int) -> list[LogRun]:
        return [LogRun("0", self.world.started_at, is_current=True)]

    def log_tail(self, rank: int, lines: int, run: str | None = None) -> str:
        if run not in (None, "0"):
            return ""
        if self.world.state == "failed":  # what rank 0 logs before it exits with code 3
            return (
                f"2026-12-02T04:18:30.114+00:00 rank{rank} INFO dgpp.head: loading {BROKEN_MODEL}\n"
                f"2026-12-02T04:18:34.387+00:00 rank{rank} ERROR dgpp.head: cannot serve: "
                f"ModelLoadError: cannot load the model {BROKEN_MODEL}\n"
                f"2026-12-02T04:18:34.401+00:00 rank{rank} INFO uvicorn.error: Shutting down"
            )
        return f"rank{rank} INFO serving"


class FakeEngine:
    def __init__(self, world: FakeWorld, deployment: Deployment) -> None:
        self.world = world
        self.deployment = deployment

    async def health(self) -> Health:
        world = self.world
        if world.state == "down":
            return Health(None, error="ConnectError: connection refused")
        if world.state != "serving":
            body: dict[str, Any] = {"state": world.state}
            if world.state == "failed":
                body["error"] = "the model cannot load"
            return Health(503, body)
        uptime = round(time.time() - world.started_at, 1)
        return Health(200, {"state": "serving", "model": world.model, "uptime_s": uptime})

    async def metrics(self) -> dict[str, Any] | None:
        if self.world.state != "serving":
            return None
        method, depth = self.world.speculative
        return {
            **METRICS,
            **self.world.self_check,
            "service": asdict(self.world.service.counters()),
            "spec_decode": {**METRICS["spec_decode"], "method": method, "depth": depth},
        }

    async def prometheus(self) -> str | None:
        """`/metrics` as the engine's own collector writes it, from the world's service."""
        if self.world.state != "serving":
            return None
        registry = build_registry(self.world.service, lambda: self.world.model, lambda: None)
        return render(registry).decode()

    async def models(self) -> list[str] | None:
        return [self.world.model] if self.world.state == "serving" else None

    async def drain(self) -> dict[str, Any] | None:
        if self.world.state != "serving":
            return None
        self.world.actions.append("drain")
        self.world.draining = True
        return {"draining": True, "running": self.world.running, "waiting": 0}

    async def undrain(self) -> dict[str, Any] | None:
        self.world.actions.append("undrain")
        self.world.draining = False
        return {"draining": False, "running": 0, "waiting": 0}

    async def reload(self) -> tuple[bool, str]:
        """As rank 0's POST /admin/reload: the file read again, its changes from the deployment
        this engine runs taken when all are live (`live_changes`), else refused."""
        if self.world.state != "serving" or self.world.refuse_reload:
            return False, "HTTP 404" if self.world.refuse_reload else "ConnectError"
        new = resolve_raw(json.loads(self.world.deployment_path.read_text()))
        try:
            changes = live_changes(self.deployment, new)
        except RestartRequiredError as err:
            return False, err.message
        self.world.actions.append("reload")
        self.world.model = served_names(new)[0]
        return True, ", ".join(f"{c.path} {c.old_text} -> {c.new_text}" for c in changes)

    async def nodes(self) -> list[dict[str, Any]] | None:
        return self.world.nodes if self.world.state != "down" else None
