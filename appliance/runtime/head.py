"""Rank 0's process: the HTTP port (bound first, kept through every failure), the world's
generations (form, serve, lose a rank, re-form), and the local worker processes when there are any.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import uvicorn
from fastapi import FastAPI

from dgpp.appliance.common.exit_codes import EXIT_CONFIG, EXIT_ENGINE_FAILURE, EXIT_OK
from dgpp.appliance.common.paths import resident_dir
from dgpp.appliance.deployments.deployment import Deployment
from dgpp.appliance.runtime.http_access_log import http_server_config
from dgpp.appliance.runtime.live_reload import RETUNE_TIMEOUT_S, LiveReloader
from dgpp.appliance.runtime.local_watchdog import WATCHDOG_S
from dgpp.appliance.runtime.local_workers import LocalWorkers
from dgpp.appliance.runtime.node_probe import (
    NodeBoard,
    NodeProbe,
    NodePublisher,
    StoreLink,
    publish_interval_s,
    tcp_store_client,
)
from dgpp.appliance.runtime.sd_notify import Notifier
from dgpp.appliance.runtime.side_supervisor import head_side_models
from dgpp.appliance.runtime.stop_signals import StopSignals
from dgpp.engine.async_engine import AsyncEngine
from dgpp.engine.distributed.world_spec import WorldSpec
from dgpp.engine.engine import LLMEngine
from dgpp.engine.errors import DgppError, one_line
from dgpp.engine.head import Head
from dgpp.engine.planning.resolved import ResolvedConfig
from dgpp.engine.server.app import attach_state, create_app, detach_state, mark_failed
from dgpp.engine.server.core.config import ServerConfig
from dgpp.engine.server.pipeline.state import ServerState
from dgpp.engine.server.routes.admin_routes import set_nodes_reader, set_reloader
from dgpp.engine.server.routes.deps import Startup, state_of

log = logging.getLogger("dgpp.head")

INSTANCE = f"{os.getpid()}-{time.time_ns()}"  # this rank 0 process, as /health names it


def process_age_s() -> float:
    """Seconds since this process started (interpreter start and imports included)."""
    with open("/proc/self/stat") as stat:
        start_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as uptime:
        now_s = float(uptime.read().split()[0])
    return now_s - start_ticks / os.sysconf("SC_CLK_TCK")


@dataclass
class HeadOptions:
    resolved: ResolvedConfig  # the engine configuration every rank runs, on its checkpoint
    spec: WorldSpec
    server: ServerConfig
    log_level: str = "info"
    local_workers: bool = False  # `dgpp serve --world N`: start and supervise ranks 1..N-1 here
    local_watchdog_s: float | None = WATCHDOG_S  # a local worker silent this long is restarted
    deployment_id: str | None = None  # names the log folder on every rank
    # The deployment rank 0 runs and how to read it again for a live reload (its file with the
    # command line's flags over it; None: nothing to reload), and --api-key, which wins over
    # the file's key at every read.
    deployment: Deployment | None = None
    reread: Callable[[], Deployment] | None = None
    api_key: str | None = None


def run_head(options: HeadOptions) -> int:
    """Serve until SIGTERM/SIGINT; returns the process exit code."""
    import_s = process_age_s()
    app = create_app(None, options.server)
    server = uvicorn.Server(
        http_server_config(
            app, options.server.host, options.server.port, options.log_level, options.server.uds
        )
    )
    runtime = HeadRuntime(options, app, server, import_s, publish_interval_s(os.environ))
    sides = None
    if options.deployment is not None:
        sides = head_side_models(options.deployment, options.server, options.deployment_id,
                                 options.log_level, options.local_workers)  # fmt: skip
    app.state.dgpp_sides = sides
    if sides is not None:
        sides.start()
    workers = None
    if options.local_workers and options.spec.world_size and options.spec.world_size > 1:
        timeouts = options.spec.timeouts
        workers = LocalWorkers(
            options.spec.world_size,
            options.spec.port,
            timeouts,
            options.log_level,
            secret=options.spec.secret,
            watchdog_s=options.local_watchdog_s,
        )
        workers.start()
    thread = threading.Thread(target=runtime.run, name="dgpp-head", daemon=True)
    thread.start()
    reloads = StopSignals((signal.SIGHUP,))  # `systemctl reload`: see live_reload
    threading.Thread(target=runtime.reload_on_signal, args=(reloads,), daemon=True).start()
    # uvicorn turns SIGTERM/SIGINT into a graceful shutdown, then raises the signal again with
    # the handlers found here: make those no-ops so an orderly stop exits 0, not -15.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: None)
    try:
        server.run()
    finally:
        runtime.stop()
        if workers is not None:
            workers.stop()
        if sides is not None:
            sides.stop()
    return runtime.exit_code


def node_board(spec: WorldSpec, publish_s: float) -> NodeBoard:
    """Rank 0's node snapshots: its own (published into its store like every rank's, through a
    client connection of its own so that a store call made for HTTP never waits behind the
    rendezvous), and every rank's read back for GET /admin/nodes."""
    world_size = spec.world_size or 1
    link = StoreLink(tcp_store_client(spec.head, spec.port)) if world_size > 1 else None
    return NodeBoard(world_size, NodePublisher(NodeProbe(0), link, publish_s), link)


class HeadRuntime:
    """Runs the head's generations on its own thread; the HTTP server runs on the main thread."""

    def __init__(
        self,
        options: HeadOptions,
        app: FastAPI,
        server: uvicorn.Server,
        import_s: float,
        node_publish_s: float,
    ) -> None:
        self.options = options
        self.app = app
        self.server = server
        self.head = Head(
            options.resolved,
            options.spec,
            options.deployment_id,
            resident_dir(),
        )
        self.exit_code = EXIT_OK
        self.import_s = import_s
        self._stop = threading.Event()
        self._async_engine: AsyncEngine | None = None
        self._lost_at: float | None = None
        # What systemd is told (Type=notify): taken before the local workers start, so they
        # do not inherit NOTIFY_SOCKET.
        self.notifier = Notifier.from_environment()
        self._phase = "starting"  # starting, re-forming, serving, stopping, failed
        self._reason: str | None = None  # why the world is not serving, one line
        self.nodes = node_board(options.spec, node_publish_s)
        set_nodes_reader(app, self.nodes.read)
        self.reloader: LiveReloader | None = None
        self._live = threading.Lock()  # a reload's changes against a world starting to serve
        if options.deployment is not None:
            reloader = LiveReloader(
                options.deployment, options.reread, self._apply, options.api_key
            )
            self.reloader = reloader
            set_reloader(app, reloader.reload)

    def reload_on_signal(self, signals: StopSignals) -> None:
        """Reload on each SIGHUP until the runtime stops."""
        while not self._stop.is_set():
            if not signals.wait(1.0):
                continue
            signals.take()
            if self.reloader is None:
                log.warning("SIGHUP: this rank 0 has no deployment to reload")
            else:
                self.reloader.reload_logged()

    def _apply(
        self, deployment: Deployment, engine: dict[str, Any], server: dict[str, Any]
    ) -> None:
        """A live reload's changed knobs (by name), for the engine's next step, the HTTP
        server's next request, and every world formed from now on."""
        from dgpp.appliance.deployments.log import follow_deployment, record_deployment

        with self._live:
            options = self.options
            options.resolved = replace(
                options.resolved, engine=replace(options.resolved.engine, **engine)
            )
            options.server = replace(options.server, **server)
            self.head.resolved, self.head.config = options.resolved, options.resolved.engine
            async_engine = self._async_engine
            if async_engine is not None:
                async_engine.queue_limit = options.server.queue_limit
                if engine and not async_engine.retune(options.resolved.engine, RETUNE_TIMEOUT_S):
                    log.warning("the engine takes the new knobs once its long step ends")
            state = state_of(self.app)
            if state is not None:
                state.config = options.server
                state.served_model_names = options.server.served_model_names
            ident, _ = record_deployment(deployment)
            follow_deployment(options.deployment_id, ident, 0)
            options.deployment_id = ident

    def run(self) -> None:
        self.notifier.watch(self.status_line, self._stop)
        self.notifier.keep_alive(self._stop)
        self.nodes.own.start(self._stop)
        retry_s = 1.0
        while not self._stop.is_set():
            try:
                engine = self.head.form()
            except DgppError as err:  # rank 0 itself cannot run this configuration
                self._fatal(EXIT_CONFIG, f"{type(err).__name__}: {err}")
                return
            except Exception as err:  # a rank refused, failed to load, or was lost meanwhile
                log.warning("forming the world failed: %s", one_line(err))
                self._unavailable("re-forming" if self._lost_at else "starting", err)
                self.head.dissolve(orderly=False)
                self._stop.wait(retry_s)
                retry_s = min(retry_s * 2, 15.0)
                continue
            retry_s = 1.0
            self._serve(engine)
            if self._stop.is_set():
                return
            failure = self._async_engine.failure if self._async_engine else None
            self._lost_at = time.monotonic()
            log.error("the world broke (%s); re-forming", one_line(failure))
            self._unavailable("re-forming", failure)
            assert self._async_engine is not None
            self._async_engine.stop(self.options.spec.timeouts.shutdown_s)
            self._async_engine = None
            self.head.dissolve(orderly=False)

    def _serve(self, engine: LLMEngine) -> None:
        options = self.options
        timeouts = options.spec.timeouts
        with self._live:  # a reload meanwhile applies to this world's parts too
            async_engine = AsyncEngine(
                engine,
                queue_limit=options.server.queue_limit,
                heartbeat_s=timeouts.heartbeat_s,
            )
            async_engine.start()
            self._async_engine = async_engine
            sides = options.deployment.side_models if options.deployment is not None else []
            state = ServerState(
                async_engine,
                options.server,
                options.server.served_model_names,
                tuple(side.name for side in sides),
            )
            attach_state(self.app, state, self._details())
        log.info("sampling defaults from the checkpoint: %s", state.sampling_defaults.describe())
        self._log_ready()
        self._notify_serving()
        poll_s = min(1.0, timeouts.step_watchdog_s / 4)
        while not self._stop.is_set() and not async_engine.wait_failed(poll_s):
            started = async_engine.step_started
            if started is not None and time.monotonic() - started > timeouts.step_watchdog_s:
                log.critical(
                    "a step has run for over %.0f s (timeouts.step_watchdog_s); exiting so the "
                    "supervisor restarts this rank",
                    timeouts.step_watchdog_s,
                )
                logging.shutdown()
                os._exit(EXIT_ENGINE_FAILURE)

    def _log_ready(self) -> None:
        phases = self.head.phases
        if self._lost_at is None:
            phases.seconds = {"import": self.import_s, **phases.seconds}
            log.info("ready in %s", phases.describe())
        else:
            log.info(
                "world re-formed %.2f s after the failure: %s",
                time.monotonic() - self._lost_at,
                phases.describe(),
            )
        log.info(
            "serving %s as %s on %s:%d (world of %d)",
            self.options.resolved.checkpoint,
            ", ".join(self.options.server.served_model_names),
            self.options.server.host,
            self.options.server.port,
            self.head.world_size,
        )

    def _notify_serving(self) -> None:
        """READY=1 the first time a world serves, once the HTTP port is bound; STATUS each time."""
        while not self.server.started and not self._stop.wait(0.05):
            pass
        self._phase, self._reason = "serving", None
        self.notifier.notify(ready=not self.notifier.is_ready, status=self.status_line())

    def status_line(self) -> str:
        """The line `systemctl status dgpp@rank0` shows; polled while a world forms."""
        head, server = self.head, self.options.server
        address = f"{server.host}:{server.port}"
        if self._phase == "serving":
            generation = f", generation {head.world.generation}" if head.world else ""
            names = ", ".join(server.served_model_names)
            return f"serving {names} on {address} (world of {head.world_size}{generation})"
        if self._phase in ("stopping", "failed"):
            return f"{self._phase}: {self._reason}" if self._reason else self._phase
        step = (
            f"loading {self.options.resolved.checkpoint.name}"
            if head.engine is None
            else "rejoining"
        )
        if head.world_size > 1 and head.world is None:
            missing = head.missing_ranks or tuple(range(1, head.world_size))
            step = "waiting for ranks " + ", ".join(str(rank) for rank in missing)
        if not self.server.started:
            step = f"binding {address}; {step}"
        reason = f" after {self._reason}" if self._reason else ""
        return f"{self._phase}{reason}: {step}"

    def _details(self) -> dict[str, object]:
        # `instance` changes with every rank 0 process: a console that restarted rank 0 waits
        # for a new one instead of guessing from uptimes.
        details: dict[str, object] = {"world_size": self.head.world_size, "instance": INSTANCE}
        if self.options.deployment_id is not None:
            details["deployment_id"] = self.options.deployment_id
        if self.head.world is not None:
            details["generation"] = self.head.world.generation
        return details

    def _unavailable(self, phase: str, error: BaseException | None) -> None:
        self._phase, self._reason = phase, one_line(error) if error else None
        details = self._details()
        if self.head.missing_ranks:
            details["missing_ranks"] = list(self.head.missing_ranks)
        detach_state(self.app, Startup(phase, one_line(error) if error else None, details))

    def _fatal(self, code: int, message: str) -> None:
        log.error("cannot serve: %s", message)
        self._phase, self._reason = "failed", message
        self.notifier.notify(status=self.status_line())
        self.exit_code = code
        mark_failed(self.app, message)
        self.server.should_exit = True

    def stop(self) -> None:
        """Orderly stop: finish the engine thread, tell the workers, drop the groups."""
        if self._phase != "failed":
            self._phase, self._reason = "stopping", None
        self.notifier.notify(stopping=True, status=self.status_line())
        self._stop.set()
        if self._async_engine is not None:
            self._async_engine.stop(self.options.spec.timeouts.shutdown_s)
            self._async_engine = None
        self.head.dissolve(orderly=True)
