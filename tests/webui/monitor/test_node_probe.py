"""GPU readings through a stand-in NVML, the clock warning, a machine without a GPU, and the
overview's rows built from every rank's snapshot."""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict
from types import SimpleNamespace
from typing import Any

import httpx

from dgpp.appliance.runtime.node_probe import GpuReading, GpuReport, NvmlProbe, gpu_report_of
from dgpp.webui.deployments.store import EngineTarget
from dgpp.webui.monitor.node_probe import (
    NodesClient,
    clock_warnings,
    local_node,
    node_view,
    read_node,
)
from tests.webui.fakes import node_snapshot


class FakeNvml:
    NVML_CLOCK_SM = 1
    NVML_CLOCK_GRAPHICS = 0
    NVML_CLOCK_ID_APP_CLOCK_TARGET = 1
    NVML_TEMPERATURE_GPU = 0
    nvmlClocksEventReasonHwSlowdown = 0x8
    nvmlClocksEventReasonSwPowerCap = 0x4

    def __init__(self, clock: int, busy: int, reasons: int = 0) -> None:
        self.clock, self.busy, self.reasons = clock, busy, reasons

    def nvmlInit(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        return f"gpu{index}"

    def nvmlDeviceGetName(self, handle: Any) -> bytes:
        return b"NVIDIA GB10"

    def nvmlDeviceGetClock(self, handle: Any, clock: int, ident: int) -> int:
        return 2400

    def nvmlDeviceGetMaxClockInfo(self, handle: Any, clock: int) -> int:
        raise RuntimeError("not supported")

    def nvmlDeviceGetClockInfo(self, handle: Any, clock: int) -> int:
        return self.clock if clock == self.NVML_CLOCK_SM else self.clock - 10

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        return 61

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        return 45_500

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: Any) -> int:
        raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        return SimpleNamespace(gpu=self.busy, memory=10)

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int:
        return self.reasons


def test_a_busy_gpu_far_below_its_clock_target_is_warned_about() -> None:
    report = NvmlProbe(lambda: FakeNvml(clock=900, busy=97, reasons=0x8)).read()
    (gpu,) = report.gpus
    assert report.available
    assert (gpu.name, gpu.sm_clock_mhz, gpu.target_clock_mhz) == ("NVIDIA GB10", 900, 2400)
    assert (gpu.temperature_c, gpu.power_w, gpu.power_limit_w) == (61, 45.5, None)
    assert gpu.throttle_reasons == ("hardware slowdown",)
    assert (gpu.graphics_clock_mhz, gpu.max_clock_mhz) == (890, None)  # max: NotSupported
    assert clock_warnings(report, 0.7) == [
        "GPU 0 runs at 900 MHz, 38% of its 2400 MHz target, while 97% busy (hardware slowdown)"
    ]


def test_an_idle_gpu_may_clock_down() -> None:
    report = NvmlProbe(lambda: FakeNvml(clock=300, busy=2)).read()
    assert clock_warnings(report, 0.7) == []
    report = NvmlProbe(lambda: FakeNvml(clock=2300, busy=99)).read()
    assert clock_warnings(report, 0.7) == []


def test_a_power_brake_is_reported_even_when_idle() -> None:
    report = GpuReport(
        True, gpus=(GpuReading(0, "x", 300, 2400, throttle_reasons=("power brake",)),)
    )
    assert clock_warnings(report, 0.7) == ["GPU 0: power brake active"]


def test_no_driver_means_unavailable_not_an_error() -> None:
    def missing() -> Any:
        raise OSError("NVML Shared Library Not Found")

    node = read_node(NvmlProbe(missing), 0.7)
    assert node.gpu == GpuReport(False, "unavailable: NVML Shared Library Not Found")
    assert node.warnings == ()
    assert node.cpu.count >= 1 and len(node.cpu.load) == 3


def test_a_snapshot_round_trips_through_json() -> None:
    report = NvmlProbe(lambda: FakeNvml(clock=900, busy=97, reasons=0x8)).read()
    assert gpu_report_of(json.loads(json.dumps(asdict(report)))) == report
    newer = {"available": True, "gpus": [{"index": 0, "name": "x", "fan_pct": 30}]}
    assert gpu_report_of(newer).gpus == (GpuReading(0, "x"),)  # unknown keys are dropped


def test_each_node_gets_its_row_and_its_own_warnings() -> None:
    slow = node_snapshot(1, "spark-2", sm_clock_mhz=900, target_clock_mhz=2400, utilisation_pct=97)
    slow["gpu"]["gpus"][0] |= {"temperature_c": 71, "power_w": 88.25, "graphics_clock_mhz": 905}
    view = node_view(slow, 0.7)
    assert view["warnings"] == [
        "rank 1 (spark-2): GPU 0 runs at 900 MHz, 38% of its 2400 MHz target, while 97% busy"
    ]
    assert view["summary"] == {
        "gpus": ["0 GB10: SM 900 of 2400 MHz (graphics 905 MHz, max -), 71 °C, 88.2 W, 97 % busy"],
        "cpu_freq": "2800 MHz of 3900",
        "governor": "performance",
        "load": "1.50 1.25 1.00",
        "busy": "12 %",
    }
    fine = node_view(node_snapshot(0, "spark-1"), 0.7)
    assert fine["warnings"] == [] and fine["summary"]["gpus"] == ["unavailable: no driver"]
    silent = node_view({"rank": 3, "hostname": None, "time": None, "error": "no reading yet"}, 0.7)
    assert silent["summary"]["gpus"] == ["no reading yet"]
    assert silent["summary"]["cpu_freq"] == "-" and silent["warnings"] == []


def test_the_local_fallback_has_the_same_shape() -> None:
    def missing() -> Any:
        raise OSError("NVML Shared Library Not Found")

    view = local_node(NvmlProbe(missing), 0.7)
    assert view["rank"] is None and view["hostname"] and view["age_s"] == 0.0
    assert view["summary"]["gpus"] == ["unavailable: NVML Shared Library Not Found"]
    assert set(view["summary"]) == {"gpus", "cpu_freq", "governor", "load", "busy"}


def test_the_nodes_client_sends_the_admin_key_and_treats_failures_as_no_answer() -> None:
    seen: list[str | None] = []
    answers = iter([httpx.Response(200, json={"nodes": [{"rank": 0}, "junk"]})])

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization"))
        assert request.url.path == "/admin/nodes"
        return next(answers, httpx.Response(401, json={"error": {}}))

    target = EngineTarget("http://127.0.0.1:1", "api-key", "sekrit")
    client = NodesClient(target, transport=httpx.MockTransport(answer))
    assert asyncio.run(client.nodes()) == [{"rank": 0}]
    assert asyncio.run(client.nodes()) is None  # 401
    # The admin key (the API key does not open /admin/*); without one, no key at all.
    keyless = NodesClient(
        EngineTarget("http://127.0.0.1:1", "api-key"), transport=httpx.MockTransport(answer)
    )
    assert asyncio.run(keyless.nodes()) is None
    assert seen == ["Bearer sekrit", "Bearer sekrit", None]

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused")

    down = NodesClient(
        EngineTarget("http://127.0.0.1:1", None), transport=httpx.MockTransport(refuse)
    )
    assert asyncio.run(down.nodes()) is None
