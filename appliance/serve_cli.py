"""`dgpp serve`: the engine and the OpenAI-compatible HTTP server in this process (world 1)."""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path
from typing import Any

from dgpp.appliance.cluster_secret_file import new_secret, read_cluster_secret
from dgpp.appliance.deployment import (
    Deployment,
    checkpoint_of,
    engine_config,
    parse_deployment,
    server_config,
    world_spec,
    world_timeouts,
)
from dgpp.appliance.deployment_files import resolve
from dgpp.appliance.engine_options import engine_knobs

log = logging.getLogger("dgpp.serve")


def add_server_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default=None, help="bind address (127.0.0.1)")
    group.add_argument("--port", type=int, default=None, help="HTTP port (18080)")
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
    group.add_argument(
        "--served-model-name",
        action="append",
        default=[],
        dest="served_model_names",
        help="name clients use for the model (repeatable; the first is reported); a pattern "
        "such as 'claude-*' answers to every matching name, '*' to any name",
    )
    group.add_argument("--default-max-tokens", type=int, default=None, help="(8192)")
    group.add_argument(
        "--max-tokens-policy",
        choices=["clamp", "reject"],
        default=None,
        help="a max_tokens beyond what the context leaves after the prompt: clamp (default: "
        "generate until the context is full) or reject (context_length_exceeded)",
    )
    group.add_argument(
        "--default-chat-template-kwargs",
        type=_json_object,
        default=None,
        help="JSON object passed to the chat template, e.g. '{\"enable_thinking\": false}'; "
        "request chat_template_kwargs win",
    )
    group.add_argument(
        "--generation-config",
        choices=["auto", "none"],
        default=None,
        help="auto (default): sampling settings a request leaves out come from the "
        "checkpoint's generation_config.json; none: the OpenAI defaults",
    )
    group.add_argument(
        "--tool-call-parser",
        choices=["auto", "hermes", "glm45", "deepseek_v3", "harmony", "qwen3_coder"],
        default=None,
        help="how the model writes tool calls and reasoning; auto (default): from its chat "
        "template",
    )
    group.add_argument("--queue-limit", type=int, default=None, help="(256)")
    group.add_argument(
        "--stats-log-interval",
        type=float,
        default=None,
        metavar="SECONDS",
        help="seconds between stats log lines (throughput, queues, KV use, prefix-cache hit "
        "rate), logged only after activity; 0 turns the log off",
    )
    group.add_argument("--log-level", default="info")


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not JSON: {err}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


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


SPEC_FLAGS = {
    "speculative": "method",
    "spec_depth": "depth",
    "spec_ngram_max": "ngram_max",
    "spec_ngram_min": "ngram_min",
}


def serve_deployment(args: argparse.Namespace) -> Deployment:
    """The deployment file (or an empty one) with the command line's settings applied."""
    raw: dict[str, Any] = {}
    if args.deployment:
        raw = resolve(Path(args.deployment)).model_dump(exclude_unset=True)
    raw.setdefault("model", "default")
    if args.model is not None:
        raw["model"] = args.model
    if args.world_size is not None:
        raw["world_size"] = args.world_size
    raw.setdefault("engine", {}).update(engine_knobs(args))
    http = raw.setdefault("http", {})
    for key, value in (
        ("host", args.host),
        ("port", args.port),
        ("api_key_file", args.api_key_file),
        ("default_max_tokens", args.default_max_tokens),
        ("max_tokens_policy", args.max_tokens_policy),
        ("queue_limit", args.queue_limit),
        ("stats_log_interval_s", args.stats_log_interval),
        ("default_chat_template_kwargs", args.default_chat_template_kwargs),
        ("generation_config", args.generation_config),
        ("tool_call_parser", args.tool_call_parser),
    ):
        if value is not None:
            http[key] = value
    if args.served_model_names:
        http["served_model_names"] = args.served_model_names
    if args.rendezvous_port is not None:
        raw.setdefault("rendezvous", {})["port"] = args.rendezvous_port
    knobs = raw["engine"]
    # Flags whose settings live in their own sections of the deployment.
    if "resident_cache" in knobs:
        raw.setdefault("resident_cache", {})["enabled"] = knobs.pop("resident_cache")
    for flag, key in SPEC_FLAGS.items():
        if flag in knobs:
            raw.setdefault("speculative", {})[key] = knobs.pop(flag)
    return parse_deployment(raw, "the command line", api_key_given=args.api_key is not None)


def run_serve(args: argparse.Namespace) -> int:
    """Bind the HTTP port at once (health answers 503 `starting`), form the world and load the
    model in the background, then serve; ranks 1..N-1 run as supervised local processes."""
    from dataclasses import replace

    from dgpp.appliance.head_runtime import HeadOptions, run_head
    from dgpp.appliance.local_watchdog import watchdog_seconds
    from dgpp.appliance.rank_cli import configure_logging
    from dgpp.appliance.timeout_env import apply_env_overrides
    from dgpp.engine.config import ModelConfig
    from dgpp.engine.models.registry import model_class

    configure_logging(args.log_level, 0)
    deployment = serve_deployment(args)
    server = server_config(deployment, args.api_key)  # reads the key files, refuses empty keys
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
    model_class(ModelConfig.from_checkpoint(checkpoint))
    engine = engine_config(deployment)
    world_size = deployment.world_size
    if world_size > 1 and engine.device == "cpu" and engine.num_threads is None:
        # N ranks on one machine share its cores; oversubscribed OpenMP pools crawl.
        engine = replace(engine, num_threads=max(1, (os.cpu_count() or 1) // world_size))
    timeouts = apply_env_overrides(world_timeouts(deployment), os.environ)
    from dgpp.appliance.deployment_log import attach_rank_log, record_deployment

    ident, _ = record_deployment(deployment)
    attach_rank_log(ident, 0)
    options = HeadOptions(
        deployment_id=ident,
        engine=engine,
        checkpoint=checkpoint,
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
    )
    return run_head(options)
