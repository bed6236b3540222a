"""`create_app(state)`: the FastAPI application of rank 0."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request, Response

from dgpp.engine.server import anthropic_routes, chat_routes, completion_routes, misc_routes
from dgpp.engine.server.body_limit import BodyLimitMiddleware
from dgpp.engine.server.config import ServerConfig
from dgpp.engine.server.deps import Startup
from dgpp.engine.server.errors import APIError, error_response, install_error_handlers
from dgpp.engine.server.state import ServerState

OPEN_PATHS = ("/health", "/docs", "/openapi.json", "/redoc")


def create_app(state: ServerState | None, config: ServerConfig | None = None) -> FastAPI:
    """The application. With `state=None` it starts in the `starting` phase (health 503, every
    model route 503 `starting`) until `attach_state` hands it the loaded engine."""
    config = config or (state.config if state is not None else ServerConfig())
    app = FastAPI(title="dgpp", version="0.1.0", description="OpenAI-compatible LLM serving")
    app.state.dgpp = state
    app.state.dgpp_startup = Startup()
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, limit=config.max_body_bytes)
    app.include_router(misc_routes.router)
    app.include_router(chat_routes.router)
    app.include_router(completion_routes.router)
    app.include_router(anthropic_routes.router)

    @app.middleware("http")
    async def guard(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > config.max_body_bytes:
            return error_response(
                APIError(
                    413,
                    f"request body over {config.max_body_bytes} bytes",
                    code="request_too_large",
                ),
                request.url.path,
            )
        if config.api_key is not None and request.url.path not in OPEN_PATHS:
            presented = request.headers.get("x-api-key") or ""
            bearer = request.headers.get("authorization", "")
            if bearer.lower().startswith("bearer "):
                presented = bearer[7:].strip()
            if not hmac.compare_digest(presented.encode(), config.api_key.encode()):
                return error_response(
                    APIError(
                        401,
                        "invalid or missing API key",
                        type_="authentication_error",
                        code="invalid_api_key",
                    ),
                    request.url.path,
                )
        return await call_next(request)

    return app


def attach_state(app: FastAPI, state: ServerState) -> None:
    """The model is loaded: start serving it."""
    app.state.dgpp = state


def mark_failed(app: FastAPI, error: str) -> None:
    app.state.dgpp_startup = Startup(phase="failed", error=error)
