"""Typed dependencies shared by the routers; tests replace them through `dependency_overrides`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, FastAPI, Request

from dgpp.engine.server.errors import RETRY_AFTER_SECONDS, APIError
from dgpp.engine.server.metrics import RequestTracker, ServiceMetrics, request_tracker
from dgpp.engine.server.state import ServerState


@dataclass
class Startup:
    """Where the server is before its `ServerState` exists: loading the model, or failed to."""

    phase: str = "starting"  # "starting" | "failed"
    error: str | None = None


def get_state(request: Request) -> ServerState:
    state: ServerState | None = request.app.state.dgpp
    if state is not None:
        return state
    startup: Startup = request.app.state.dgpp_startup
    if startup.phase == "failed":
        raise APIError(
            503,
            f"the engine failed to start: {startup.error}",
            type_="server_error",
            code="engine_failure",
            headers={"Retry-After": RETRY_AFTER_SECONDS},
        )
    raise APIError(
        503,
        "the model is still loading",
        type_="server_error",
        code="starting",
        headers={"Retry-After": RETRY_AFTER_SECONDS},
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
    """The request's `RequestTracker` (see `metrics.py`), shared with the error handlers."""
    tracker = request_tracker(request.scope, any_path=True)
    return tracker if tracker is not None else RequestTracker(ServiceMetrics())


State = Annotated[ServerState, Depends(get_state)]
Tracker = Annotated[RequestTracker, Depends(get_tracker)]
