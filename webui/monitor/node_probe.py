"""The overview's nodes: every rank's snapshot from rank 0's `GET /admin/nodes`, or this node's own
readings when the engine does not answer, each with the console's clock warnings.

The probing itself lives in `dgpp.appliance.runtime.node_probe` (every rank runs it). A busy GPU
whose SM clock sits far below its target (clocks drop silently after a power fault) gets a
warning, with the throttle reasons NVML gives."""

from __future__ import annotations

import socket
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import httpx

from dgpp.appliance.runtime.node_probe import (
    CpuReading,
    GpuReading,
    GpuReport,
    NvmlProbe,
    gpu_report_of,
    read_cpu,
)
from dgpp.webui.deployments.store import EngineTarget

BUSY_PERCENT = 50  # a GPU below this utilisation may clock down on purpose


@dataclass(frozen=True)
class NodeReport:
    gpu: GpuReport
    cpu: CpuReading
    warnings: tuple[str, ...] = field(default_factory=tuple)


def clock_warnings(report: GpuReport, fraction: float) -> list[str]:
    warnings = []
    for gpu in report.gpus:
        clock, target, busy = gpu.sm_clock_mhz, gpu.target_clock_mhz, gpu.utilisation_pct or 0
        if clock is not None and target and busy >= BUSY_PERCENT and clock < fraction * target:
            why = f" ({', '.join(gpu.throttle_reasons)})" if gpu.throttle_reasons else ""
            warnings.append(
                f"GPU {gpu.index} runs at {clock} MHz, {100 * clock / target:.0f}% of its "
                f"{target} MHz target, while {busy}% busy{why}"
            )
        elif {"hardware slowdown", "power brake"} & set(gpu.throttle_reasons):
            warnings.append(f"GPU {gpu.index}: {', '.join(gpu.throttle_reasons)} active")
    return warnings


def read_node(gpus: NvmlProbe, clock_warning_fraction: float) -> NodeReport:
    report = gpus.read()
    return NodeReport(report, read_cpu(), tuple(clock_warnings(report, clock_warning_fraction)))


def node_view(snapshot: dict[str, Any], fraction: float) -> dict[str, Any]:
    """One row of the overview's node table: a rank's snapshot (as `/admin/nodes` gives it) with
    its clock warnings, each naming the node, and the row's cells as text (`summary`)."""
    gpu, cpu = snapshot.get("gpu"), snapshot.get("cpu")
    try:
        report = gpu_report_of(gpu) if isinstance(gpu, dict) else None
    except (TypeError, ValueError):  # a snapshot this console cannot read
        report = None
    rank, host = snapshot.get("rank"), snapshot.get("hostname") or "unknown host"
    where = f"rank {rank} ({host})" if rank is not None else host
    warnings = clock_warnings(report, fraction) if report is not None else []
    if report is None:
        lines = [str(snapshot.get("error") or "no reading")]
    elif not report.available:
        lines = [report.reason or "unavailable"]
    else:
        lines = [_gpu_line(reading) for reading in report.gpus]
    cpu = cpu if isinstance(cpu, dict) else {}
    freq, most = cpu.get("freq_mhz"), cpu.get("max_freq_mhz")
    load = cpu.get("load")
    loads = " ".join(f"{value:.2f}" for value in load) if isinstance(load, list | tuple) else "-"
    summary = {
        "gpus": lines,
        "cpu_freq": (f"{freq:.0f} MHz" + (f" of {most:.0f}" if most else "")) if freq else "-",
        "governor": str(cpu.get("governor") or "-"),
        "load": loads,
        "busy": _unit(cpu.get("utilisation_pct"), "%"),
    }
    return {
        **snapshot,
        "warnings": [f"{where}: {warning}" for warning in warnings],
        "summary": summary,
    }


def _unit(value: Any, unit: str, digits: int = 0) -> str:
    return f"{value:.{digits}f} {unit}" if isinstance(value, int | float) else "-"


def _gpu_line(gpu: GpuReading) -> str:
    clock = gpu.sm_clock_mhz if gpu.sm_clock_mhz is not None else "-"
    target = gpu.target_clock_mhz or "-"
    graphics, most = _unit(gpu.graphics_clock_mhz, "MHz"), _unit(gpu.max_clock_mhz, "MHz")
    return (
        f"{gpu.index} {gpu.name}: SM {clock} of {target} MHz (graphics {graphics}, max {most}), "
        f"{_unit(gpu.temperature_c, '°C')}, {_unit(gpu.power_w, 'W', 1)}, "
        f"{_unit(gpu.utilisation_pct, '% busy')}"
    )


def local_node(gpus: NvmlProbe, fraction: float) -> dict[str, Any]:
    """This node's readings in the same shape, for when the engine does not answer (the console
    runs on the head, but without rank 0 it cannot say which rank this is)."""
    report = gpus.read()
    snapshot = {
        "rank": None,
        "hostname": socket.gethostname(),
        "time": time.time(),
        "age_s": 0.0,
        "gpu": asdict(report),
        "cpu": asdict(read_cpu()),
    }
    return node_view(snapshot, fraction)


class NodesApi(Protocol):
    """Every rank's snapshot from rank 0; None when the engine does not answer usefully."""

    async def nodes(self) -> list[dict[str, Any]] | None: ...


class NodesClient:
    """`GET /admin/nodes` on rank 0, with the admin key the deployment names."""

    def __init__(
        self,
        target: EngineTarget,
        timeout_s: float = 5.0,
        transport: httpx.AsyncBaseTransport | None = None,  # tests answer in place of rank 0
    ) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self.transport = transport

    async def nodes(self) -> list[dict[str, Any]] | None:
        headers = self.target.headers("/admin/nodes")
        try:
            async with httpx.AsyncClient(
                timeout=self.timeout_s, trust_env=False, transport=self.transport
            ) as client:
                response = await client.get(f"{self.target.url}/admin/nodes", headers=headers)
            body = response.json() if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None
        nodes = body.get("nodes") if isinstance(body, dict) else None
        if not isinstance(nodes, list) or not nodes:
            return None
        return [node for node in nodes if isinstance(node, dict)]
