"""Drives an `LLMEngine` from a dedicated thread and streams each request's outputs to asyncio.

The HTTP layer lives on an asyncio loop; the engine step is blocking compute. One engine thread
owns the `LLMEngine` exclusively: callers hand it commands (add, abort) through a queue, and it
hands outputs back with `call_soon_threadsafe`, so no engine state is shared between threads.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from dgpp.engine.configuration.engine_config import EngineConfig
from dgpp.engine.engine import LLMEngine
from dgpp.engine.errors import DgppError
from dgpp.engine.sampling.sampling_params import SamplingParams
from dgpp.engine.scheduling.request import RequestOutput
from dgpp.engine.scheduling.stats import EngineStats

log = logging.getLogger(__name__)


class OverloadedError(DgppError):
    """The waiting queue is full; the client should retry later."""

    code = "overloaded"


class EngineFailureError(DgppError):
    """The engine stopped while serving; in-flight requests cannot complete."""

    code = "engine_failure"


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    stream: _Stream
    use_prefix_cache: bool = True
    arrival_time: float = field(default_factory=time.monotonic)  # queued (a step may be running)


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Release:
    session: str
    done: threading.Event


@dataclass(frozen=True)
class _Retune:
    config: EngineConfig
    done: threading.Event


class _Stream:
    """One request's outputs, delivered from the engine thread to an asyncio consumer."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class Admission:
    """Room reserved in the queue for some requests (`AsyncEngine.admit`). Each `generate` that
    is given it takes one; what is left is given back by `release`, or when it is collected (a
    stream whose client left before it started)."""

    def __init__(self, engine: AsyncEngine, num_requests: int) -> None:
        self._engine = engine
        self.remaining = num_requests

    def take(self) -> bool:
        """Under the engine's lock: use one reserved request; False when none is left."""
        if self.remaining <= 0:
            return False
        self.remaining -= 1
        return True

    def release(self) -> None:
        self._engine._release(self)

    def __del__(self) -> None:
        self.release()


class AsyncEngine:
    """Thread-safe, asyncio-facing front of one engine.

    `queue_limit` bounds the requests waiting beyond `max_concurrency` running ones; past it
    `generate` raises `OverloadedError` at once instead of queueing without bound. While idle the
    engine thread sends a heartbeat every `heartbeat_s` (workers of a world wait for rank 0's next
    command with a deadline; a heartbeat to a dead worker also surfaces its loss at once).
    """

    def __init__(self, engine: LLMEngine, queue_limit: int = 256, heartbeat_s: float = 5.0) -> None:
        self.engine = engine
        self.queue_limit = queue_limit
        self.heartbeat_s = heartbeat_s
        self.step_started: float | None = None  # monotonic start of the step in progress
        self._failed = threading.Event()
        self._commands: queue.SimpleQueue[_Add | _Abort | _Release | _Retune | None] = (
            queue.SimpleQueue()
        )
        self._streams: dict[str, _Stream] = {}
        self._wakeup = threading.Event()
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._num_pending = 0  # submitted, not yet finished; guarded by _lock
        # Reentrant: an Admission collected while this thread holds it gives its room back.
        self._lock = threading.RLock()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._failure is None

    @property
    def failure(self) -> BaseException | None:
        return self._failure

    def wait_failed(self, timeout: float) -> bool:
        """Block up to `timeout` seconds; True once the engine thread has failed."""
        return self._failed.wait(timeout)

    def stats(self) -> EngineStats:
        """A snapshot of the engine's queues and counters, for the metrics endpoints."""
        return self.engine.stats()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="dgpp-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._commands.put(None)
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def admit(self, num_requests: int = 1) -> Admission:
        """Reserve room for `num_requests` requests now, or raise what `generate` would (failure,
        overload): a response that must not fail once it has started (a stream) admits its
        requests before it starts and passes the `Admission` to `generate`."""
        with self._lock:
            self._check_room(num_requests)
            self._num_pending += num_requests
        return Admission(self, num_requests)

    def _check_room(self, num_requests: int) -> None:
        """Under `_lock`: raise unless `num_requests` more requests fit."""
        if self._failure is not None:
            raise EngineFailureError(f"the engine has failed: {self._failure}")
        if self._num_pending + num_requests > self._capacity:
            raise OverloadedError(
                f"the server is at its queue limit ({self.queue_limit} waiting requests)"
            )

    def _release(self, admission: Admission) -> None:
        with self._lock:
            self._num_pending -= admission.remaining
            admission.remaining = 0

    @property
    def _capacity(self) -> int:
        return self.engine.config.max_concurrency + self.queue_limit

    async def generate(
        self,
        prompt: list[int],
        params: SamplingParams,
        request_id: str,
        use_prefix_cache: bool = True,
        admission: Admission | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until it finishes. Leaving the iteration early (the client
        went away) aborts the request, and its KV blocks are freed at the next step. With an
        `admission` that still holds room, the request uses that room instead of asking anew."""
        stream = _Stream(asyncio.get_running_loop())
        with self._lock:  # the failure path drains the queue under this lock: no add is lost
            if admission is not None and admission.take():
                if self._failure is not None:
                    self._num_pending -= 1
                    raise EngineFailureError(f"the engine has failed: {self._failure}")
            else:
                self._check_room(1)
                self._num_pending += 1
            self._commands.put(_Add(request_id, prompt, params, stream, use_prefix_cache))
        self._wakeup.set()
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            with self._lock:
                self._num_pending -= 1
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))
        self._wakeup.set()

    def release_session(self, session: str, timeout: float = 10.0) -> bool:
        """End an agent session (`dgpp.engine.cache.sessions`): its cached blocks become
        anonymous, given up first. Blocks until the engine thread has done it (a step in
        progress finishes first), up to `timeout` seconds; False if it had not by then."""
        done = threading.Event()
        self._commands.put(_Release(session, done))
        self._wakeup.set()
        return done.wait(timeout)

    def retune(self, config: EngineConfig, timeout: float) -> bool:
        """Hand the engine thread `config` (only live knobs changed: `LLMEngine.retune`); True
        once it runs with it, before its next step. Blocks up to `timeout` seconds (a step in
        progress finishes first); False if the engine did not take it by then."""
        done = threading.Event()
        self._commands.put(_Retune(config, done))
        self._wakeup.set()
        return done.wait(timeout)

    def _run(self) -> None:
        try:
            while True:
                if not self._drain_commands():
                    return
                if not self.engine.has_unfinished():
                    if not self._wakeup.wait(self.heartbeat_s):
                        self.engine.heartbeat()
                    self._wakeup.clear()
                    continue
                self.step_started = time.monotonic()
                outputs = self.engine.step()
                self.step_started = None
                for output in outputs:
                    stream = self._streams.get(output.request_id)
                    if stream is None:
                        continue
                    if output.finished:
                        del self._streams[output.request_id]
                    stream.put(output)
        except BaseException as err:
            log.exception("engine thread failed")
            failure = EngineFailureError(f"the engine failed while serving: {err}")
            with self._lock:
                self._failure = err
                streams = list(self._streams.values())
                while not self._commands.empty():
                    command = self._commands.get_nowait()
                    if isinstance(command, _Add):
                        streams.append(command.stream)
            for stream in streams:
                stream.put(failure)
            self._streams.clear()
            self._failed.set()

    def _drain_commands(self) -> bool:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
            if command is None:
                return False
            if isinstance(command, _Abort):
                if command.request_id in self._streams:
                    self.engine.abort(command.request_id)
                continue
            if isinstance(command, _Release):
                sessions = self.engine.block_manager.sessions
                sessions.release(command.session)
                sessions.apply_releases()
                command.done.set()
                continue
            if isinstance(command, _Retune):
                self.engine.retune(command.config)
                command.done.set()
                continue
            try:
                self.engine.add_request(
                    command.prompt,
                    command.params,
                    command.request_id,
                    command.use_prefix_cache,
                    arrival_time=command.arrival_time,
                )
            except DgppError as err:
                command.stream.put(err)
                continue
            self._streams[command.request_id] = command.stream
