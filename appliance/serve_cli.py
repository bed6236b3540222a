"""`dgpp serve`: the engine and the OpenAI-compatible HTTP server in this process (world 1)."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from dgpp.appliance.engine_options import engine_knobs

log = logging.getLogger("dgpp.serve")


def add_server_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1")
    group.add_argument("--port", type=int, default=18080)
    group.add_argument("--api-key", default=None, help="require this key (Bearer or x-api-key)")
    group.add_argument(
        "--served-model-name",
        action="append",
        default=[],
        dest="served_model_names",
        help="name clients use for the model (repeatable; the first is reported)",
    )
    group.add_argument("--default-max-tokens", type=int, default=8192)
    group.add_argument(
        "--default-chat-template-kwargs",
        type=_json_object,
        default={},
        help="JSON object passed to the chat template, e.g. '{\"enable_thinking\": false}'; "
        "request chat_template_kwargs win",
    )
    group.add_argument("--queue-limit", type=int, default=256)
    group.add_argument(
        "--stats-log-interval",
        type=float,
        default=10.0,
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


def run_serve(args: argparse.Namespace) -> int:
    """Bind the HTTP port at once (health answers 503 `starting`), load the model in the
    background, then serve. A model that fails to load stops the process with exit code 1."""
    import threading

    import uvicorn

    from dgpp.engine.async_engine import AsyncEngine
    from dgpp.engine.config import EngineConfig, ModelConfig
    from dgpp.engine.engine import LLMEngine
    from dgpp.engine.llm import resolve_checkpoint
    from dgpp.engine.models.registry import model_class
    from dgpp.engine.server.app import attach_state, create_app, mark_failed
    from dgpp.engine.server.config import ServerConfig
    from dgpp.engine.server.state import ServerState

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(message)s"
    )
    # Cheap checks first, so a wrong model reference or knob fails before anything binds.
    checkpoint = resolve_checkpoint(args.model)
    model_class(ModelConfig.from_checkpoint(checkpoint))
    engine_config = EngineConfig(model=args.model, **engine_knobs(args))
    names = tuple(args.served_model_names) or (
        "default" if args.model == "default" else Path(args.model).name or args.model,
    )
    config = ServerConfig(
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        served_model_names=names,
        default_max_tokens=args.default_max_tokens,
        queue_limit=args.queue_limit,
        stats_log_interval_s=args.stats_log_interval,
        default_chat_template_kwargs=args.default_chat_template_kwargs,
    )
    app = create_app(None, config)
    server = uvicorn.Server(
        uvicorn.Config(app, host=config.host, port=config.port, log_level=args.log_level)
    )
    engines: list[AsyncEngine] = []
    failed: list[BaseException] = []

    def load() -> None:
        try:
            engine = LLMEngine(engine_config, checkpoint)
            async_engine = AsyncEngine(engine, queue_limit=config.queue_limit)
            async_engine.start()
            engines.append(async_engine)
            attach_state(app, ServerState(async_engine, config, names))
            log.info(
                "serving %s as %s on %s:%d", checkpoint, ", ".join(names), config.host, config.port
            )
        except BaseException as err:
            log.exception("loading %s failed", checkpoint)
            failed.append(err)
            mark_failed(app, f"{type(err).__name__}: {err}")
            server.should_exit = True

    threading.Thread(target=load, name="dgpp-load", daemon=True).start()
    try:
        server.run()
    finally:
        for async_engine in engines:
            async_engine.stop()
    return 1 if failed else 0
