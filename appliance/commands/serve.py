"""`dgpp serve`: the engine and the OpenAI-compatible HTTP server in this process (world 1)."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import Any

from dgpp.appliance.commands.engine_options import add_knob_flags, deployment_overrides
from dgpp.appliance.deployments.deployment import (
    Deployment,
    checkpoint_of,
    engine_config,
    parse_deployment,
    server_config,
    world_spec,
    world_timeouts,
)
from dgpp.appliance.deployments.files import resolve
from dgpp.appliance.runtime.cluster_secret_file import new_secret, read_cluster_secret
from dgpp.engine.server.core.config import ServerConfig

log = logging.getLogger("dgpp.serve")


def add_server_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    add_knob_flags(group, ServerConfig)
    group.add_argument(
        "--api-key-file",
        default=None,
        metavar="FILE",
        help="require the key this file holds (Bearer or x-api-key); sets http.api_key_file",
    )
    group.add_argument(
        "--api-key",
        default=None,
        help="require this key; other users of the machine see it in `ps`: prefer --api-key-file",
    )
    group.add_argument("--log-level", default="info")


def add_world_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("world")
    group.add_argument(
        "--deployment", default=None, help="deployment file; the flags given here override it"
    )
    group.add_argument(
        "--world",
        type=int,
        default=None,
        dest="world_size",
        help="ranks of the tensor-parallel world, all started on this machine (default 1)",
    )
    group.add_argument("--rendezvous-port", type=int, default=None, dest="rendezvous_port")


def serve_deployment(args: argparse.Namespace) -> Deployment:
    """The deployment file (or an empty one) with the command line's settings applied; a
    command without some of `dgpp serve`'s flags (`dgpp eval`) leaves those to the file."""
    raw: dict[str, Any] = {}
    if args.deployment:
        raw = resolve(Path(args.deployment)).model_dump(exclude_unset=True)
    raw.setdefault("model", "default")
    if args.model is not None:
        raw["model"] = args.model
    if getattr(args, "world_size", None) is not None:
        raw["world_size"] = args.world_size
    for section, values in deployment_overrides(args).items():
        raw.setdefault(section, {}).update(values)
    if getattr(args, "api_key_file", None) is not None:
        raw.setdefault("http", {})["api_key_file"] = args.api_key_file
    if getattr(args, "rendezvous_port", None) is not None:
        raw.setdefault("rendezvous", {})["port"] = args.rendezvous_port
    key_given = getattr(args, "api_key", None) is not None
    return parse_deployment(raw, "the command line", api_key_given=key_given)


def run_serve(args: argparse.Namespace) -> int:
    """Bind the HTTP port at once (health answers 503 `starting`), form the world and load the
    model in the background, then serve; ranks 1..N-1 run as supervised local processes."""
    from dataclasses import replace

    from dgpp.appliance.commands.rank import configure_logging

    configure_logging(args.log_level, 0)
    deployment = serve_deployment(args)
    server = server_config(deployment, args.api_key)  # reads the key files, refuses empty keys
    # Only now the engine's imports (torch, transformers: seconds): a wrong flag or file is
    # refused at once.
    from dgpp.appliance.commands.timeout_env import apply_env_overrides
    from dgpp.appliance.runtime.head import HeadOptions, run_head
    from dgpp.appliance.runtime.local_watchdog import watchdog_seconds
    from dgpp.engine.planning.resolved import resolve as resolve_config  # not the file's `resolve`

    if args.api_key is not None:
        log.warning("--api-key is visible to every user of this machine (ps); prefer a key file")
    if deployment.http.allow_unauthenticated and server.api_key is None:
        log.warning(
            "serving %s:%d without an API key (http.allow_unauthenticated)",
            server.host,
            server.port,
        )
    # Cheap checks first, so a wrong model reference or knob fails before anything binds.
    checkpoint = checkpoint_of(deployment)
    engine = engine_config(deployment)
    world_size = deployment.world_size
    if world_size > 1 and engine.device == "cpu" and engine.num_threads is None:
        # N ranks on one machine share its cores; oversubscribed OpenMP pools crawl.
        engine = replace(engine, num_threads=max(1, (os.cpu_count() or 1) // world_size))
    resolved = resolve_config(engine, checkpoint, world_size)  # refuses before anything is written
    timeouts = apply_env_overrides(world_timeouts(deployment), os.environ)
    from dgpp.appliance.deployments.log import attach_rank_log, record_deployment

    ident, _ = record_deployment(deployment)
    attach_rank_log(ident, 0)
    options = HeadOptions(
        deployment_id=ident,
        resolved=resolved,
        # The ranks this process starts share a secret made for this run (or the node's).
        spec=replace(
            world_spec(deployment, 0, timeouts),
            secret=(read_cluster_secret(None, os.environ) or new_secret())
            if world_size > 1
            else None,
        ),
        server=server,
        log_level=args.log_level,
        local_workers=True,
        local_watchdog_s=watchdog_seconds(os.environ),
        deployment=deployment,
        # A reload reads the file again with the same flags over it (flags alone: nothing).
        reread=(lambda: serve_deployment(args)) if args.deployment else None,
        api_key=args.api_key,
    )
    return run_head(options)
