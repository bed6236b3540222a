"""A node's GPUs (through NVML, `nvidia-ml-py`) and CPU (through `psutil` and sysfs), and how every
rank's readings reach rank 0.

A machine without an NVIDIA driver reports its GPUs as unavailable, with the reason; that is a
normal state, not an error. Every rank publishes a JSON snapshot of its node every few seconds
(`DGPP_NODE_PUBLISH_S`, default 5) under `dgpp/nodes/rank<N>` in rank 0's rendezvous store,
through a client connection of its own; rank 0 reads them back for `GET /admin/nodes`. Rank 0
being away (restarting, re-forming, not up yet) only means no snapshot is published meanwhile:
publishing never blocks a rank's work and never raises.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol, TypeVar

import psutil

from dgpp.engine.errors import one_line

log = logging.getLogger("dgpp.nodes")

PUBLISH_ENV = "DGPP_NODE_PUBLISH_S"
DEFAULT_PUBLISH_S = 5.0
STORE_TIMEOUT_S = 2.0  # connecting to, and one call on, rank 0's store
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
T = TypeVar("T")


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
    graphics_clock_mhz: int | None = None
    max_clock_mhz: int | None = None  # the SM clock's maximum


@dataclass(frozen=True)
class GpuReport:
    available: bool
    reason: str = ""  # why GPUs are unavailable, "unavailable: ..."
    gpus: tuple[GpuReading, ...] = ()


@dataclass(frozen=True)
class CpuReading:
    count: int
    freq_mhz: float | None
    max_freq_mhz: float | None
    governor: str | None
    load: tuple[float, float, float]
    utilisation_pct: float


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
    max_clock = _try(lambda: nvml.nvmlDeviceGetMaxClockInfo(handle, sm))
    target = (
        _try(lambda: nvml.nvmlDeviceGetClock(handle, sm, nvml.NVML_CLOCK_ID_APP_CLOCK_TARGET))
        or max_clock
    )
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
        graphics_clock_mhz=_try(
            lambda: nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_GRAPHICS)
        ),
        max_clock_mhz=max_clock or None,
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


def gpu_report_of(data: Mapping[str, Any]) -> GpuReport:
    """A snapshot's `gpu` section back as a report (unknown keys, from a newer rank, dropped)."""
    known = {item.name for item in fields(GpuReading)}
    gpus = []
    for gpu in data.get("gpus") or ():
        values = {key: value for key, value in gpu.items() if key in known}
        values["throttle_reasons"] = tuple(values.get("throttle_reasons") or ())
        gpus.append(GpuReading(**values))
    return GpuReport(bool(data.get("available")), str(data.get("reason") or ""), tuple(gpus))


class NodeProbe:
    """One rank's snapshot of its node, as JSON-able data."""

    def __init__(
        self,
        rank: int,
        gpus: NvmlProbe | None = None,
        cpu: Callable[[], CpuReading] = read_cpu,
        hostname: str | None = None,
    ) -> None:
        self.rank = rank
        self.gpus = gpus or NvmlProbe()
        self.cpu = cpu
        self.hostname = hostname or socket.gethostname()

    def snapshot(self) -> dict[str, Any]:
        """`time` is this node's wall clock when the readings were taken."""
        return {
            "rank": self.rank,
            "hostname": self.hostname,
            "time": time.time(),
            "gpu": asdict(self.gpus.read()),
            "cpu": asdict(self.cpu()),
        }


def node_key(rank: int) -> str:
    return f"dgpp/nodes/rank{rank}"


def publish_interval_s(env: Mapping[str, str]) -> float:
    """`DGPP_NODE_PUBLISH_S` seconds between two snapshots (default 5)."""
    value = env.get(PUBLISH_ENV, "").strip()
    try:
        seconds = float(value) if value else DEFAULT_PUBLISH_S
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        log.warning(
            "%s=%r is not a positive number; using %g", PUBLISH_ENV, value, DEFAULT_PUBLISH_S
        )
        return DEFAULT_PUBLISH_S
    return seconds


class Store(Protocol):
    """What is used of a `torch.distributed.Store`."""

    def set(self, key: str, value: str) -> None: ...

    def check(self, keys: list[str]) -> bool: ...

    def get(self, key: str) -> bytes: ...


def tcp_store_client(
    head: str, port: int, timeout_s: float = STORE_TIMEOUT_S
) -> Callable[[], Store]:
    """Connects a client of rank 0's store. A plain socket tries the port first: torch's client
    prints a C++ stack trace to stderr for every failed attempt, and rank 0 being away is normal."""

    def connect() -> Store:
        with socket.create_connection((head, port), timeout=timeout_s):
            pass
        import torch.distributed as dist

        return dist.TCPStore(head, port, is_master=False, timeout=timedelta(seconds=timeout_s))

    return connect


class StoreLink:
    """A client of rank 0's store, connected on first use and again after any failure. Calls are
    serialised, and never raise: a failure is logged at debug and answered with None/False."""

    def __init__(self, connect: Callable[[], Store]) -> None:
        self._connect = connect
        self._store: Store | None = None
        self._lock = threading.Lock()

    def _call(self, what: str, operation: Callable[[Store], T]) -> T | None:
        with self._lock:
            try:
                if self._store is None:
                    self._store = self._connect()
                return operation(self._store)
            except Exception as err:
                self._store = None
                log.debug("rank 0's store (%s): %s", what, one_line(err))
                return None

    def set(self, key: str, value: str) -> bool:
        return self._call(f"set {key}", lambda store: store.set(key, value) or True) is True

    def get(self, key: str) -> bytes | None:
        """The value, or None when the key is not there (a get would wait for it)."""

        def read(store: Store) -> bytes | None:
            return store.get(key) if store.check([key]) else None

        return self._call(f"get {key}", read)


class NodePublisher:
    """Takes this node's snapshot every `interval_s` and sets it in rank 0's store (when there is
    a store: a world of one keeps it here only)."""

    def __init__(self, probe: NodeProbe, link: StoreLink | None, interval_s: float) -> None:
        self.probe = probe
        self.link = link
        self.interval_s = interval_s
        self.latest: dict[str, Any] | None = None

    def publish(self) -> dict[str, Any]:
        snapshot = self.probe.snapshot()
        self.latest = snapshot
        if self.link is not None:
            self.link.set(node_key(self.probe.rank), json.dumps(snapshot))
        return snapshot

    def run(self, stop: threading.Event) -> None:
        while True:
            try:
                self.publish()
            except Exception as err:  # a probe must never take the rank down
                log.debug("node snapshot failed: %s", one_line(err))
            if stop.wait(self.interval_s):
                return

    def start(self, stop: threading.Event) -> threading.Thread:
        """Publish on a daemon thread until `stop` is set (a connection attempt to an absent
        rank 0 takes up to `STORE_TIMEOUT_S`, which no rank's loop should wait for)."""
        thread = threading.Thread(target=self.run, args=(stop,), name="dgpp-nodes", daemon=True)
        thread.start()
        return thread


class NodeBoard:
    """Rank 0's view of every rank's latest snapshot: its own from memory, the others from the
    store. A rank that has published nothing yet appears with `time` None and an `error`."""

    def __init__(self, world_size: int, own: NodePublisher, link: StoreLink | None) -> None:
        self.world_size = world_size
        self.own = own
        self.link = link

    def read(self) -> list[dict[str, Any]]:
        own = self.own.latest or self.own.probe.snapshot()
        nodes = [own]
        for rank in range(1, self.world_size):
            raw = self.link.get(node_key(rank)) if self.link is not None else None
            snapshot = _parse(raw) if raw is not None else None
            if snapshot is None:
                error = "no reading from this rank yet" if raw is None else "unreadable reading"
                snapshot = {"rank": rank, "hostname": None, "time": None, "error": error}
            nodes.append(snapshot)
        return nodes


def _parse(raw: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
