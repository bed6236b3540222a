"""Memory previews kept once computed: a plan is a pure function of the effective deployment, the
model's source and the memory it is planned against, and counting a large MoE's weights takes
seconds, so each is computed once — on request (a preview waits for it) or in the background
(the Models page asks for every template's and shows them as they arrive).

Background threads (one per worker process: two where there are two cores) work through what
the page asked for, in the page's order; a preview that needs a plan not yet started computes it
itself rather than wait in that queue, and a plan being computed is shared by whoever asks for
it meanwhile. The console asks for every row's plan when it starts; the first plan queued
starts the worker processes, each importing the model families before its first plan, so the
page finds them known or computing.

Where the console gives it a `store` directory, each plan is also written there (a JSON file
named by its key) and read back by a later console: a plan's key holds everything it depends on
(the effective deployment, the model's facts or config, the memory, and `code_stamp`: dgpp's
version and its source files), so a stored plan is never stale. Closing does not wait for the
plan being computed: background plans run in a worker process of their own (spawned at the
first, niced), which closing terminates at once (issue 45: a console must stop within 2 s
whatever it computes). In the console's own process a niced thread holding the interpreter
lock starved the request threads on a busy machine, and at exit a thread abandoned in torch's
code aborted the process."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import multiprocessing
import multiprocessing.pool
import os
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from dgpp.appliance.deployments.deployment import Deployment, parse_deployment
from dgpp.engine.errors import ModelLoadError
from dgpp.engine.planning.memory_plan import GIB, DeviceMemory
from dgpp.webui.plans import worker_pool
from dgpp.webui.plans.memory_preview import MemoryPreview, budget_memory, gpu_memory, preview_memory
from dgpp.webui.plans.store import PlanStore, code_stamp

log = logging.getLogger(__name__)

MAX_PLANS = 256
WAIT_S = 0.5  # how often a background plan's wait looks whether the cache was closed


class ClosedError(Exception):
    """The cache closed while a plan was being computed for it."""


def _plan_dumped(raw: dict[str, Any], memory: DeviceMemory) -> MemoryPreview:
    """`preview_memory` in the worker process, of a deployment sent as its JSON dump (its
    section models are built at run time, so they do not pickle)."""
    return preview_memory(parse_deployment(raw, "the deployment", api_key_given=True), memory)


def _model_stamp(deployment: Deployment) -> str:
    """Which model facts a plan of `deployment` reads: the checkpoint's config (path and mtime)
    when it is on this machine, else the shipped facts."""
    from dgpp.appliance.deployments.deployment import checkpoint_of
    from dgpp.appliance.models.facts import facts_path

    try:
        config = Path(checkpoint_of(deployment)) / "config.json"
        return f"{config}:{config.stat().st_mtime_ns}"
    except (ModelLoadError, OSError):
        facts = facts_path(deployment.model)
        return f"facts:{facts.stat().st_mtime_ns}" if facts.is_file() else "none"


def plan_key(deployment: Deployment, memory: DeviceMemory | None) -> str:
    """What a plan depends on. Host RAM moves all the time: it counts to the GiB. Without
    `memory`: the key of the deployment's latest plan against any memory."""
    parts: dict[str, object] = {
        "deployment": deployment.model_dump(mode="json"),
        "model": _model_stamp(deployment),
        "code": code_stamp(),
    }
    if memory is not None:
        free = memory.free_bytes if memory.is_accelerator else memory.free_bytes // GIB
        parts["memory"] = [memory.total_bytes, free, memory.description, memory.is_accelerator]
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


class PlanCache:
    def __init__(
        self,
        plan: Callable[[Deployment, DeviceMemory], MemoryPreview] = preview_memory,
        gpu: Callable[[int], DeviceMemory | None] = gpu_memory,
        store: Path | None = None,
    ) -> None:
        self._plan = plan
        self._gpu = gpu
        self._store = PlanStore(store) if store is not None else None
        self._gpus: dict[int, DeviceMemory | None] = {}  # a GPU's size does not change
        self._lock = threading.Lock()
        self._done: OrderedDict[str, MemoryPreview] = OrderedDict()
        self._running: dict[str, Future[MemoryPreview]] = {}
        self._queued: set[str] = set()
        self._queue: queue.Queue[tuple[str, Deployment, DeviceMemory] | None] = queue.Queue()
        self._workers: list[threading.Thread] = []
        self._pool: multiprocessing.pool.Pool | None = None  # the background plans' process
        # The real planner runs in the worker process; a test's planner in the thread.
        self._in_process = plan is not preview_memory
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
        background). Where only the memory moved (a CPU deployment's free host RAM crossed a
        GiB) the latest plan against other memory stands in while the new one is computed: the
        page's column stays filled; a preview (`plan`) always plans against the memory now."""
        memory = self.memory_for(deployment)
        key = plan_key(deployment, memory)
        known = self.get(key)
        if known is None and schedule:
            self.schedule(key, deployment, memory)
        return known if known is not None else self.get(f"latest-{plan_key(deployment, None)}")

    def get(self, key: str) -> MemoryPreview | None:
        with self._lock:
            known = self._done.get(key)
        if known is None and self._store is not None and (known := self._store.read(key)):
            self._remember(key, known)
        return known

    def _remember(self, key: str, result: MemoryPreview) -> None:
        with self._lock:
            self._done[key] = result
            while len(self._done) > MAX_PLANS:
                self._done.popitem(last=False)

    def compute(
        self, key: str, deployment: Deployment, memory: DeviceMemory, background: bool = False
    ) -> MemoryPreview:
        """The plan under `key`, computed now unless it is known or already being computed
        (blocks: call it from a worker thread); `background`: in the worker process."""
        known = self.get(key)
        if known is not None:
            return known
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
            # Never raises for a plan's own problems.
            planner = self._in_worker if background and not self._in_process else self._plan
            result = planner(deployment, memory)
        except BaseException as err:
            with self._lock:
                del self._running[key]
            future.set_exception(err)
            raise
        latest = f"latest-{plan_key(deployment, None)}"
        for each in (key, latest):
            if self._store is not None:
                self._store.write(each, result)
            self._remember(each, result)
        with self._lock:
            del self._running[key]
        future.set_result(result)
        return result

    def schedule(self, key: str, deployment: Deployment, memory: DeviceMemory) -> None:
        """Compute `key` in the background unless it is known, running or queued."""
        if self.get(key) is not None:  # in memory or in the store
            return
        with self._lock:
            if self._closed or key in self._done or key in self._running or key in self._queued:
                return
            self._queued.add(key)
            while len(self._workers) < (1 if self._in_process else worker_pool.WORKERS):
                name = f"dgpp-webui-plans-{len(self._workers)}"
                self._workers.append(threading.Thread(target=self._work, name=name, daemon=True))
                self._workers[-1].start()
            self._start_pool()  # now: the workers import torch and the families (seconds)
        self._queue.put((key, deployment, memory))

    def _start_pool(self) -> None:
        if self._pool is None and not self._in_process and not self._closed:
            self._pool = worker_pool.take_early() or worker_pool.new_pool()

    def _in_worker(self, deployment: Deployment, memory: DeviceMemory) -> MemoryPreview:
        """`self._plan` in the worker process; `ClosedError` once the cache closes."""
        with self._lock:
            if self._closed:
                raise ClosedError
            self._start_pool()
            assert self._pool is not None
            dumped = deployment.model_dump(mode="json")
            pending = self._pool.apply_async(_plan_dumped, (dumped, memory))
        while True:
            try:
                return pending.get(WAIT_S)
            except multiprocessing.TimeoutError:
                if self._closed:
                    raise ClosedError from None

    def close(self, timeout: float = 2 * WAIT_S) -> None:
        """Drop what is queued and terminate the worker process (the plan it computes is
        abandoned); wait up to `timeout` for the thread that waited on it."""
        with self._lock:
            self._closed = True
            workers, pool = list(self._workers), self._pool
            self._queued.clear()
        if pool is not None:
            pool.terminate()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        for _ in workers:
            self._queue.put(None)
        for worker in workers:
            worker.join(timeout)

    def _work(self) -> None:
        if self._in_process:  # a test's planner: below everything else, as the worker process
            with contextlib.suppress(AttributeError, OSError):
                os.setpriority(
                    os.PRIO_PROCESS, threading.get_native_id(), worker_pool.BACKGROUND_NICENESS
                )
        while True:
            item = self._queue.get()
            if item is None:
                return
            key, deployment, memory = item
            try:
                self.compute(key, deployment, memory, background=True)
            except ClosedError:
                return
            except Exception:  # the plan says what it cannot plan; this is a bug: keep working
                log.exception("planning %s in the background failed", deployment.model)
            finally:
                with self._lock:
                    self._queued.discard(key)
