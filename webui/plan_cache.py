"""Memory previews kept once computed: a plan is a pure function of the effective deployment, the
model's source and the memory it is planned against, and counting a large MoE's weights takes
seconds, so each is computed once — on request (a preview waits for it) or in the background
(the Models page asks for every template's and shows them as they arrive).

One background thread works through what the page asked for, in order; a preview that needs a
plan not yet started computes it itself rather than wait in that queue, and a plan being computed
is shared by whoever asks for it meanwhile."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

from dgpp.appliance.deployment import Deployment
from dgpp.engine.errors import ModelLoadError
from dgpp.engine.memory_plan import GIB, DeviceMemory
from dgpp.webui.memory_preview import MemoryPreview, budget_memory, gpu_memory, preview_memory

log = logging.getLogger(__name__)

MAX_PLANS = 256
BACKGROUND_NICENESS = 19


def _model_stamp(deployment: Deployment) -> str:
    """Which model facts a plan of `deployment` reads: the checkpoint's config (path and mtime)
    when it is on this machine, else the shipped facts."""
    from dgpp.appliance.deployment import checkpoint_of
    from dgpp.appliance.model_facts import facts_path

    try:
        config = Path(checkpoint_of(deployment)) / "config.json"
        return f"{config}:{config.stat().st_mtime_ns}"
    except (ModelLoadError, OSError):
        facts = facts_path(deployment.model)
        return f"facts:{facts.stat().st_mtime_ns}" if facts.is_file() else "none"


def plan_key(deployment: Deployment, memory: DeviceMemory) -> str:
    """What a plan depends on. Host RAM moves all the time: it counts to the GiB."""
    free = memory.free_bytes if memory.is_accelerator else memory.free_bytes // GIB
    parts = {
        "deployment": deployment.model_dump(mode="json"),
        "model": _model_stamp(deployment),
        "memory": [memory.total_bytes, free, memory.description, memory.is_accelerator],
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


class PlanCache:
    def __init__(
        self,
        plan: Callable[[Deployment, DeviceMemory], MemoryPreview] = preview_memory,
        gpu: Callable[[int], DeviceMemory | None] = gpu_memory,
    ) -> None:
        self._plan = plan
        self._gpu = gpu
        self._gpus: dict[int, DeviceMemory | None] = {}  # a GPU's size does not change
        self._lock = threading.Lock()
        self._done: OrderedDict[str, MemoryPreview] = OrderedDict()
        self._running: dict[str, Future[MemoryPreview]] = {}
        self._queued: set[str] = set()
        self._queue: queue.Queue[tuple[str, Deployment, DeviceMemory] | None] = queue.Queue()
        self._worker: threading.Thread | None = None
        self._closed = False

    def memory_for(self, deployment: Deployment) -> DeviceMemory:
        return budget_memory(deployment, self._gpu_reading)

    def _gpu_reading(self, index: int) -> DeviceMemory | None:
        if index not in self._gpus:
            self._gpus[index] = self._gpu(index)
        return self._gpus[index]

    def plan(self, deployment: Deployment) -> MemoryPreview:
        """`deployment`'s plan, computed now if need be (blocks: call it from a thread)."""
        memory = self.memory_for(deployment)
        return self.compute(plan_key(deployment, memory), deployment, memory)

    def known(self, deployment: Deployment, schedule: bool = False) -> MemoryPreview | None:
        """`deployment`'s plan if it is known; else None (with `schedule`, it is computed in the
        background)."""
        memory = self.memory_for(deployment)
        key = plan_key(deployment, memory)
        known = self.get(key)
        if known is None and schedule:
            self.schedule(key, deployment, memory)
        return known

    def get(self, key: str) -> MemoryPreview | None:
        with self._lock:
            return self._done.get(key)

    def compute(self, key: str, deployment: Deployment, memory: DeviceMemory) -> MemoryPreview:
        """The plan under `key`, computed now unless it is known or already being computed
        (blocks: call it from a worker thread)."""
        with self._lock:
            known = self._done.get(key)
            if known is not None:
                return known
            future = self._running.get(key)
            owner = future is None
            if owner:
                future = self._running[key] = Future()
        assert future is not None
        if not owner:
            return future.result()
        try:
            result = self._plan(deployment, memory)  # never raises for a plan's own problems
        except BaseException as err:
            with self._lock:
                del self._running[key]
            future.set_exception(err)
            raise
        with self._lock:
            del self._running[key]
            self._done[key] = result
            while len(self._done) > MAX_PLANS:
                self._done.popitem(last=False)
        future.set_result(result)
        return result

    def schedule(self, key: str, deployment: Deployment, memory: DeviceMemory) -> None:
        """Compute `key` in the background unless it is known, running or queued."""
        with self._lock:
            if self._closed or key in self._done or key in self._running or key in self._queued:
                return
            self._queued.add(key)
            if self._worker is None:
                self._worker = threading.Thread(
                    target=self._work, name="dgpp-webui-plans", daemon=True
                )
                self._worker.start()
        self._queue.put((key, deployment, memory))

    def close(self, timeout: float = 60.0) -> None:
        """Drop what is queued and wait (up to `timeout`) for the plan being computed."""
        with self._lock:
            self._closed = True
            worker = self._worker
            self._queued.clear()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if worker is not None:
            self._queue.put(None)
            worker.join(timeout)

    def _work(self) -> None:
        # Below everything else on the machine: on a single node the engine runs beside it.
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICENESS)
        while True:
            item = self._queue.get()
            if item is None:
                return
            key, deployment, memory = item
            try:
                self.compute(key, deployment, memory)
            except Exception:  # the plan says what it cannot plan; this is a bug: keep working
                log.exception("planning %s in the background failed", deployment.model)
            finally:
                with self._lock:
                    self._queued.discard(key)
