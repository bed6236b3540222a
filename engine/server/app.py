"""`create_app(state)`: the FastAPI application of rank 0."""

from __future__ import annotations

import ipaddress
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request, Response

from dgpp.engine.scheduling.stats import EngineStats
from dgpp.engine.server.core.body_limit import BodyLimitMiddleware
from dgpp.engine.server.core.config import ServerConfig, concrete_names
from dgpp.engine.server.core.errors import APIError, install_error_handlers, respond
from dgpp.engine.server.core.priority import key_matches, presented_key
from dgpp.engine.server.core.side_proxy import SideProxy
from dgpp.engine.server.metrics.prometheus import build_registry
from dgpp.engine.server.metrics.service import ServiceMetrics
from dgpp.engine.server.metrics.stats_log import periodic_stats_log
from dgpp.engine.server.pipeline.state import ServerState
from dgpp.engine.server.routes import (
    admin_routes,
    anthropic_routes,
    chat_routes,
    completion_routes,
    metrics_routes,
    misc_routes,
    pooling_routes,
    responses_routes,
    session_routes,
    side_routes,
)
from dgpp.engine.server.routes.deps import Startup, state_of

# /metrics is for scrapers, which usually carry no key; it holds counts only, no request content.
OPEN_PATHS = ("/health", "/metrics", "/docs", "/openapi.json", "/redoc")


def create_app(state: ServerState | None, config: ServerConfig | None = None) -> FastAPI:
    """The application. With `state=None` it starts in the `starting` phase (health 503, every
    model route 503 `starting`) until `attach_state` hands it the loaded engine."""
    config = config or (state.config if state is not None else ServerConfig())
    metrics = ServiceMetrics()

    def model_name() -> str:
        current = state_of(app)
        if current is not None:
            return current.model_name
        return concrete_names(config.served_model_names)[0] if config.served_model_names else ""

    def engine_stats() -> EngineStats | None:
        current = state_of(app)
        return current.engine.stats() if current is not None else None

    def side_cards() -> list[dict[str, Any]]:
        sides = app.state.dgpp_sides
        return sides.listing() if sides is not None else []

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async with periodic_stats_log(config.stats_log_interval_s, engine_stats, metrics.counters):
            yield

    app = FastAPI(
        title="dgpp",
        version="0.1.0",
        description="OpenAI-compatible LLM serving",
        lifespan=lifespan,
    )
    app.state.dgpp = state
    app.state.dgpp_startup = Startup()
    app.state.dgpp_metrics = metrics
    app.state.dgpp_prometheus = build_registry(metrics, model_name, engine_stats, side_cards)
    app.state.dgpp_sides = None  # side models' router (`core.side_proxy`), where there are any
    install_error_handlers(app)
    app.add_middleware(SideProxy)  # inside the body limit and the key check
    app.add_middleware(BodyLimitMiddleware, limit=config.max_body_bytes)
    app.include_router(misc_routes.router)
    app.include_router(chat_routes.router)
    app.include_router(completion_routes.router)
    app.include_router(anthropic_routes.router)
    app.include_router(responses_routes.router)
    app.include_router(metrics_routes.router)
    app.include_router(session_routes.router)
    app.include_router(pooling_routes.router)
    app.include_router(side_routes.router)
    admin_routes.install(app)  # /admin/drain, /admin/undrain and the guard while draining

    @app.middleware("http")
    async def guard(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > config.max_body_bytes:
            return respond(
                request,
                APIError(
                    413,
                    f"request body over {config.max_body_bytes} bytes",
                    code="request_too_large",
                ),
            )
        refusal = _refusal(config, request)
        if refusal is not None:
            return respond(request, refusal)
        return await call_next(request)

    return app


def _refusal(config: ServerConfig, request: Request) -> APIError | None:
    """Why this request may not pass, or None. `/admin/*` takes the admin key only (the API
    key does not drain a server); without an admin key those routes answer loopback clients
    only. `/metrics` is open unless `metrics_require_key`."""
    path = request.url.path
    if path == "/admin" or path.startswith("/admin/"):
        if config.admin_key is None:
            client = request.client.host if request.client is not None else ""
            if is_loopback_client(client):
                return None
            return APIError(
                403,
                "the admin routes answer only on this machine unless the server has an admin "
                "key (http.admin_key_file)",
                type_="permission_error",
                code="admin_forbidden",
            )
        if key_matches(presented_key(request), config.admin_key):
            return None
        return APIError(
            401,
            "invalid or missing admin key",
            type_="authentication_error",
            code="invalid_api_key",
        )
    keys = [policy.key for policy in config.api_keys]
    if config.api_key is not None:
        keys.append(config.api_key)
    if not keys:
        return None
    if path in OPEN_PATHS and not (path == "/metrics" and config.metrics_require_key):
        return None
    presented = presented_key(request)
    if any([key_matches(presented, key) for key in keys]):  # each compared: no timing hint
        return None
    return APIError(
        401, "invalid or missing API key", type_="authentication_error", code="invalid_api_key"
    )


def is_loopback_client(host: str) -> bool:
    """Whether the peer address is this machine's. Behind a reverse proxy on this machine every
    client looks local unless the proxy sets X-Forwarded-For: use an admin key there."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def attach_state(app: FastAPI, state: ServerState, details: dict[str, Any] | None = None) -> None:
    """The model is loaded: start serving it. `details` (world size, generation) go on /health."""
    app.state.dgpp = state
    app.state.dgpp_startup = Startup(phase="serving", details=details or {})


def mark_failed(app: FastAPI, error: str) -> None:
    app.state.dgpp_startup = Startup(phase="failed", error=error)


def detach_state(app: FastAPI, startup: Startup) -> None:
    """Stop serving (the world broke): new requests get 503 with Retry-After, `/health` shows
    `startup`'s phase and details."""
    app.state.dgpp_startup = startup
    app.state.dgpp = None
