"""This node's GPUs (through NVML, `nvidia-ml-py`) and CPU (through `psutil` and sysfs).

A machine without an NVIDIA driver reports its GPUs as unavailable, with the reason; that is a
normal state, not an error. A busy GPU whose SM clock sits far below its target (clocks drop
silently after a power fault) gets a warning, with the throttle reasons NVML gives."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

BUSY_PERCENT = 50  # a GPU below this utilisation may clock down on purpose
_GOVERNOR = Path("/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor")
# NVML clock-event (throttle) reason bits, by the names nvidia-smi prints.
_REASONS = (
    ("nvmlClocksEventReasonSwPowerCap", "software power cap"),
    ("nvmlClocksEventReasonHwSlowdown", "hardware slowdown"),
    ("nvmlClocksEventReasonHwThermalSlowdown", "hardware thermal slowdown"),
    ("nvmlClocksEventReasonHwPowerBrakeSlowdown", "power brake"),
    ("nvmlClocksEventReasonSwThermalSlowdown", "software thermal slowdown"),
    ("nvmlClocksEventReasonSyncBoost", "sync boost"),
)


@dataclass(frozen=True)
class GpuReading:
    index: int
    name: str
    sm_clock_mhz: int | None = None
    target_clock_mhz: int | None = None  # the applications / locked clock target, else the max
    temperature_c: int | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    utilisation_pct: int | None = None
    throttle_reasons: tuple[str, ...] = ()


@dataclass(frozen=True)
class GpuReport:
    available: bool
    reason: str = ""  # why GPUs are unavailable
    gpus: tuple[GpuReading, ...] = ()


@dataclass(frozen=True)
class CpuReading:
    count: int
    freq_mhz: float | None
    max_freq_mhz: float | None
    governor: str | None
    load: tuple[float, float, float]
    utilisation_pct: float


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


class NvmlProbe:
    """Reads every GPU through NVML; initialises the library once, on first use."""

    def __init__(self, loader: Callable[[], Any] | None = None) -> None:
        self._loader = loader or _import_pynvml
        self._nvml: Any = None
        self._failure: str | None = None
        self._lock = threading.Lock()

    def _library(self) -> Any:
        with self._lock:
            if self._nvml is None and self._failure is None:
                try:
                    nvml = self._loader()
                    nvml.nvmlInit()
                    self._nvml = nvml
                except Exception as err:  # no package, no driver, no device: all "unavailable"
                    self._failure = _first_line(err) or type(err).__name__
            return self._nvml

    def read(self) -> GpuReport:
        nvml = self._library()
        if nvml is None:
            return GpuReport(False, f"unavailable: {self._failure}")
        try:
            count = nvml.nvmlDeviceGetCount()
        except Exception as err:
            return GpuReport(False, f"unavailable: {_first_line(err)}")
        if count == 0:
            return GpuReport(False, "unavailable: no GPU on this node")
        return GpuReport(True, gpus=tuple(_read_gpu(nvml, index) for index in range(count)))


def _import_pynvml() -> Any:
    import pynvml

    return pynvml


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else ""


def _try(call: Callable[[], Any]) -> Any:
    try:
        return call()
    except Exception:  # NVML answers NotSupported for much of what some boards lack
        return None


def _read_gpu(nvml: Any, index: int) -> GpuReading:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    name = _try(lambda: nvml.nvmlDeviceGetName(handle)) or f"GPU {index}"
    if isinstance(name, bytes):
        name = name.decode()
    sm = nvml.NVML_CLOCK_SM
    target = _try(
        lambda: nvml.nvmlDeviceGetClock(handle, sm, nvml.NVML_CLOCK_ID_APP_CLOCK_TARGET)
    ) or _try(lambda: nvml.nvmlDeviceGetMaxClockInfo(handle, sm))
    power = _try(lambda: nvml.nvmlDeviceGetPowerUsage(handle))
    limit = _try(lambda: nvml.nvmlDeviceGetEnforcedPowerLimit(handle))
    utilisation = _try(lambda: nvml.nvmlDeviceGetUtilizationRates(handle))
    reasons_mask = _try(lambda: nvml.nvmlDeviceGetCurrentClocksEventReasons(handle))
    if reasons_mask is None:
        reasons_mask = _try(lambda: nvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle))
    reasons = tuple(
        label
        for attribute, label in _REASONS
        if reasons_mask and hasattr(nvml, attribute) and reasons_mask & getattr(nvml, attribute)
    )
    return GpuReading(
        index=index,
        name=str(name),
        sm_clock_mhz=_try(lambda: nvml.nvmlDeviceGetClockInfo(handle, sm)),
        target_clock_mhz=target or None,
        temperature_c=_try(
            lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)
        ),
        power_w=power / 1000 if power is not None else None,
        power_limit_w=limit / 1000 if limit is not None else None,
        utilisation_pct=utilisation.gpu if utilisation is not None else None,
        throttle_reasons=reasons,
    )


def read_cpu() -> CpuReading:
    frequency = _try(psutil.cpu_freq)
    try:
        governor: str | None = _GOVERNOR.read_text().strip()
    except OSError:
        governor = None
    return CpuReading(
        count=os.cpu_count() or 1,
        freq_mhz=frequency.current if frequency else None,
        max_freq_mhz=frequency.max if frequency and frequency.max else None,
        governor=governor,
        load=os.getloadavg(),
        utilisation_pct=psutil.cpu_percent(None),
    )


def read_node(gpus: NvmlProbe, clock_warning_fraction: float) -> NodeReport:
    report = gpus.read()
    return NodeReport(report, read_cpu(), tuple(clock_warnings(report, clock_warning_fraction)))
