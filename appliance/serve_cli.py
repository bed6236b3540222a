"""`dgpp serve`: the engine and the OpenAI-compatible HTTP server in this process (world 1)."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from dgpp.appliance.engine_options import engine_knobs


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
    import uvicorn

    from dgpp.engine.async_engine import AsyncEngine
    from dgpp.engine.config import EngineConfig
    from dgpp.engine.engine import LLMEngine
    from dgpp.engine.llm import resolve_checkpoint
    from dgpp.engine.server.app import create_app
    from dgpp.engine.server.config import ServerConfig
    from dgpp.engine.server.state import ServerState

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(message)s"
    )
    checkpoint = resolve_checkpoint(args.model)
    engine = LLMEngine(EngineConfig(model=args.model, **engine_knobs(args)), checkpoint)
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
        default_chat_template_kwargs=args.default_chat_template_kwargs,
    )
    async_engine = AsyncEngine(engine, queue_limit=config.queue_limit)
    async_engine.start()
    app = create_app(ServerState(async_engine, config, names))
    try:
        uvicorn.run(app, host=config.host, port=config.port, log_level=args.log_level)
    finally:
        async_engine.stop()
    return 0
