"""GPU readings through a stand-in NVML, the clock warning, and a machine without a GPU."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from dgpp.webui.node_probe import GpuReading, GpuReport, NvmlProbe, clock_warnings, read_node


class FakeNvml:
    NVML_CLOCK_SM = 1
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
        return self.clock

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
