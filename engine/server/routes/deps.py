"""Typed dependencies shared by the routers; tests replace them through `dependency_overrides`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request

from dgpp.engine.server.core.errors import RETRY_AFTER_SECONDS, APIError
from dgpp.engine.server.metrics.service import RequestTracker, ServiceMetrics, request_tracker
from dgpp.engine.server.pipeline.state import ServerState


@dataclass
class Startup:
    """Where the server is while it has no engine to serve with: loading the model
    (`starting`), forming the world again after a rank was lost (`re-forming`), or `failed`."""

    phase: str = "starting"
    error: str | None = None
    details: dict[str, Any] = field(default_factory=dict)  # shown on /health


_UNAVAILABLE = {
    "starting": ("the model is still loading", "starting"),
    "re-forming": (
        "the tensor-parallel world is re-forming after a failure; retry shortly",
        "world_reforming",
    ),
}


def get_state(request: Request) -> ServerState:
    state: ServerState | None = request.app.state.dgpp
    if state is not None:
        return state
    startup: Startup = request.app.state.dgpp_startup
    if startup.phase not in _UNAVAILABLE:
        raise APIError(
            503,
            f"the engine failed to start: {startup.error}",
            type_="server_error",
            code="engine_failure",
            headers={"Retry-After": RETRY_AFTER_SECONDS},
        )
    message, code = _UNAVAILABLE[startup.phase]
    if startup.error:
        message = f"{message} ({startup.error})"
    raise APIError(
        503, message, type_="server_error", code=code, headers={"Retry-After": RETRY_AFTER_SECONDS}
    )


def current_state(request: Request) -> ServerState | None:
    """The state, or None while starting; honours a test's override of `get_state`."""
    return state_of(request.app)


def state_of(app: FastAPI) -> ServerState | None:
    """The app's state, or None while starting; honours a test's override of `get_state`."""
    override = app.dependency_overrides.get(get_state)
    if override is not None:
        return override()
    return app.state.dgpp


def get_tracker(request: Request) -> RequestTracker:
    """The request's `RequestTracker` (see `metrics/service.py`), shared with the error handlers."""
    tracker = request_tracker(request.scope, any_path=True)
    return tracker if tracker is not None else RequestTracker(ServiceMetrics())


State = Annotated[ServerState, Depends(get_state)]
Tracker = Annotated[RequestTracker, Depends(get_tracker)]
