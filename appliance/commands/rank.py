"""`dgpp rank`: run one rank of a world (what the unit `dgpp@rankN` runs).

Rank 0 reads the deployment file and serves HTTP; a worker needs only the head's address, the
rendezvous port and its rank (flags or `DGPP_HEAD`, `DGPP_RENDEZVOUS_PORT`, `DGPP_RANK`). A worker
given a deployment too refuses a world whose configuration differs from it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

from dgpp.appliance.commands.timeout_env import apply_env_overrides
from dgpp.appliance.common.exit_codes import EXIT_CONFIG, EXIT_ENGINE_FAILURE, EXIT_OK
from dgpp.appliance.common.paths import resident_dir
from dgpp.appliance.deployments.deployment import (
    Deployment,
    checkpoint_of,
    engine_config,
    server_config,
    world_spec,
    world_timeouts,
)
from dgpp.appliance.deployments.files import resolve
from dgpp.appliance.deployments.http_keys import warn_if_unauthenticated
from dgpp.appliance.runtime.cluster_secret_file import read_cluster_secret
from dgpp.appliance.runtime.sd_notify import Notifier, report_worker
from dgpp.appliance.runtime.stop_signals import StopSignals
from dgpp.engine.distributed.world_spec import WorldSpec, WorldTimeouts
from dgpp.engine.errors import ConfigError

log = logging.getLogger("dgpp.rank")


def add_rank_parser(commands: Any) -> None:
    rank = commands.add_parser("rank", help="run one rank of a tensor-parallel world")
    env = os.environ
    rank.add_argument("--deployment", default=env.get("DGPP_DEPLOYMENT"), help="deployment file")
    rank.add_argument("--rank", type=int, default=_int_env("DGPP_RANK"), help="this rank")
    rank.add_argument("--head", default=env.get("DGPP_HEAD"), help="rank 0's address")
    rank.add_argument(
        "--rendezvous-port", type=int, default=_int_env("DGPP_RENDEZVOUS_PORT"), dest="port"
    )
    rank.add_argument(
        "--cluster-secret-file",
        default=None,
        help="the cluster secret every rank holds (default: $DGPP_CLUSTER_SECRET_FILE)",
    )
    rank.add_argument("--timeouts", default=None, help=argparse.SUPPRESS)  # local backend
    rank.add_argument("--log-level", default="info")


def _int_env(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value and value.strip().isdigit() else None


def configure_logging(level: str, rank: int) -> None:
    """Every record of this process, uvicorn's included (head_runtime hands its loggers to the
    root), to standard error in the rank log format."""
    from dgpp.appliance.common.log_format import RankLogFormatter

    handler = logging.StreamHandler()
    handler.setFormatter(RankLogFormatter(rank))
    logging.basicConfig(level=level.upper(), handlers=[handler])


def run_rank(args: argparse.Namespace) -> int:
    if args.rank is None or args.rank < 0:
        raise ConfigError("--rank (or DGPP_RANK) must name this rank, 0 for the head")
    configure_logging(args.log_level, args.rank)
    deployment = load_deployment_arg(args.deployment)
    timeouts = _timeouts(args, deployment)
    secret = read_cluster_secret(args.cluster_secret_file, os.environ)
    if args.rank == 0:
        if deployment is None:
            raise ConfigError("rank 0 needs --deployment (or DGPP_DEPLOYMENT)")
        return run_head_rank(deployment, args.deployment, timeouts, args.log_level, secret)
    spec = WorldSpec(
        rank=args.rank,
        head=args.head or (deployment.rendezvous.head if deployment else "127.0.0.1"),
        port=args.port or (deployment.rendezvous.port if deployment else 29517),
        timeouts=timeouts,
        secret=secret,
    )
    return run_worker_rank(spec, expected_config(deployment))


def load_deployment_arg(path: str | None) -> Deployment | None:
    return resolve(Path(path)) if path else None


def _timeouts(args: argparse.Namespace, deployment: Deployment | None) -> WorldTimeouts:
    if args.timeouts:
        timeouts = WorldTimeouts(**json.loads(args.timeouts))
    elif deployment is not None:
        timeouts = world_timeouts(deployment)
    else:
        timeouts = WorldTimeouts()
    return apply_env_overrides(timeouts, os.environ)


def expected_config(deployment: Deployment | None) -> dict[str, Any] | None:
    """What a worker with its own deployment insists on: the model, the world size, and every
    engine knob its file sets but the live ones (rank 0's alone: a reload there changes them
    while this node's file stays as it was)."""
    if deployment is None:
        return None
    from dgpp.appliance.runtime.live_reload import live_keys

    live = live_keys()
    knobs = deployment.engine.model_dump(exclude_unset=True)
    engine = {key: value for key, value in knobs.items() if f"engine.{key}" not in live}
    return {"world_size": deployment.world_size, "engine": {"model": deployment.model, **engine}}


def run_head_rank(
    deployment: Deployment,
    path: str,
    timeouts: WorldTimeouts,
    log_level: str,
    secret: bytes | None,
) -> int:
    """Serve as rank 0 of `deployment`, read from `path` (read again on a reload)."""
    server = server_config(deployment)  # reads the key files: refuses before anything starts
    warn_if_unauthenticated(server, deployment.http.allow_unauthenticated)
    # Only now the engine's imports (torch, transformers: seconds).
    from dgpp.appliance.deployments.log import attach_rank_log, record_deployment
    from dgpp.appliance.runtime.head import HeadOptions, run_head
    from dgpp.engine.planning.resolved import resolve as resolve_config  # not the file's `resolve`

    ident, _ = record_deployment(deployment)
    attach_rank_log(ident, 0)
    checkpoint = checkpoint_of(deployment)
    resolved = resolve_config(engine_config(deployment), checkpoint, deployment.world_size)
    options = HeadOptions(
        deployment_id=ident,
        resolved=resolved,
        spec=replace(world_spec(deployment, 0, timeouts), secret=secret),
        server=server,
        log_level=log_level,
        deployment=deployment,
        reread=lambda: resolve(Path(path)),
    )
    return run_head(options)


def _publish_node(spec: WorldSpec, stop: threading.Event) -> None:
    """This node's readings into rank 0's store, every `DGPP_NODE_PUBLISH_S` seconds, on a thread
    of their own: connecting to a rank 0 that is away must not hold up this rank's main loop."""
    from dgpp.appliance.runtime.node_probe import (
        NodeProbe,
        NodePublisher,
        StoreLink,
        publish_interval_s,
        tcp_store_client,
    )

    link = StoreLink(tcp_store_client(spec.head, spec.port))
    NodePublisher(NodeProbe(spec.rank), link, publish_interval_s(os.environ)).start(stop)


def run_worker_rank(spec: WorldSpec, expected: dict[str, Any] | None) -> int:
    """Serve worlds until SIGTERM/SIGINT (exit 0), a refused configuration (3) or an
    unexpected failure (4). The rank runs on a helper thread so that a signal is handled even
    while that thread is blocked inside a collective."""
    from dgpp.engine.distributed.worker import Worker

    stop = threading.Event()
    outcome: list[int] = []
    worker = Worker(spec, expected, resident_dir())
    notifier = Notifier.from_environment()
    notifier.keep_alive(stop)
    report_worker(notifier, worker)

    def serve() -> None:
        try:
            worker.run(stop)
            outcome.append(EXIT_OK)
        except ConfigError as err:
            log.error("%s", err)
            outcome.append(EXIT_CONFIG)
        except BaseException:
            log.exception("rank %d failed", spec.rank)
            outcome.append(EXIT_ENGINE_FAILURE)
        finally:
            stop.set()
            signals.wake()

    # Never `stop.set` from a signal handler: see StopSignals.
    signals = StopSignals()
    reloads = StopSignals((signal.SIGHUP,))  # `systemctl reload dgpp@rankN` must not kill it
    _publish_node(spec, stop)
    threading.Thread(target=serve, name=f"dgpp-rank{spec.rank}", daemon=True).start()
    logged_to = None
    while not stop.is_set() and not signals.wait(0.5):
        if reloads.take() is not None:
            log.info("SIGHUP: nothing to reload on rank %d (live knobs are rank 0's)", spec.rank)
        report_worker(notifier, worker)
        if worker.deployment_id is not None and worker.deployment_id != logged_to:
            from dgpp.appliance.deployments.log import follow_deployment

            # The first world's deployment, or rank 0 switched: log to its folder.
            follow_deployment(logged_to, worker.deployment_id, spec.rank)
            logged_to = worker.deployment_id
    stop.set()
    code = outcome[0] if outcome else EXIT_OK
    notifier.notify(stopping=True, status=f"stopping with exit code {code}")
    log.info("rank %d exiting with %d", spec.rank, code)
    if (disk_store := sys.modules.get("dgpp.engine.cache.disk_store")) is not None:
        disk_store.flush_open_stores()  # prefix-cache blocks queued for the disk
    logging.shutdown()
    # Not a normal interpreter exit: the rank's thread may still be inside a collective, and
    # tearing its process group down under it aborts the process.
    os._exit(code)
