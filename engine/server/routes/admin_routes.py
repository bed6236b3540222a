"""POST /admin/drain, POST /admin/undrain and GET /admin/drain: stop admitting generation requests
before a planned restart, let the running ones finish, and say how many are left. GET /admin/nodes:
every rank's latest node snapshot (GPUs, CPU), through a reader rank 0's runtime provides.
POST /admin/reload: read the deployment again and take its live knobs without a restart, through
the reloader rank 0's runtime provides (`dgpp.appliance.runtime.live_reload`).

While draining, every new generation request (chat, completions, messages) is answered
`503 draining` with Retry-After and counted as shed; everything else (health, models, metrics,
tokenize) keeps working. The flag lives on the app, so a restarted server starts undrained.
The routes sit behind the API key like every non-open route (see `app.py`'s guard).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Receive, Scope, Send

from dgpp.engine.errors import DgppError
from dgpp.engine.server.core.errors import RETRY_AFTER_SECONDS, APIError, error_response
from dgpp.engine.server.metrics.service import GENERATION_PATHS, Outcome, request_tracker
from dgpp.engine.server.routes.deps import Startup, state_of

router = APIRouter(prefix="/admin", tags=["admin"])

DRAIN_KEY = "dgpp_drain"
NODES_KEY = "dgpp_nodes"
RELOAD_KEY = "dgpp_reload"
# Reads the deployment again and applies it: every changed key -> [old, new]; raises a
# DgppError whose code says why nothing was applied. It blocks (a file, an engine step).
Reloader = Callable[[], dict[str, list[Any]]]
RELOAD_REFUSALS = ("restart_required", "nothing_to_reload")  # 409: valid, but not live
# Every rank's latest snapshot, JSON-able dicts with at least `rank` and `time` (the wall clock
# when it was taken, None when the rank has published nothing). It may block on the network.
NodesReader = Callable[[], list[dict[str, Any]]]


@dataclass(frozen=True)
class Drain:
    """The server stopped admitting at `since` (wall clock, seconds since the epoch)."""

    since: float


def drain_of(app: FastAPI) -> Drain | None:
    return getattr(app.state, DRAIN_KEY, None)


def set_nodes_reader(app: FastAPI, reader: NodesReader | None) -> None:
    """What GET /admin/nodes answers from (set by rank 0's runtime; None: an empty list)."""
    setattr(app.state, NODES_KEY, reader)


def set_reloader(app: FastAPI, reloader: Reloader | None) -> None:
    """What POST /admin/reload runs (set by rank 0's runtime; None: the route answers 409)."""
    setattr(app.state, RELOAD_KEY, reloader)


def install(app: FastAPI) -> None:
    """The admin routes and the guard that refuses generation requests while draining."""
    setattr(app.state, DRAIN_KEY, None)
    setattr(app.state, NODES_KEY, None)
    setattr(app.state, RELOAD_KEY, None)
    app.include_router(router)
    app.add_middleware(DrainGuard)


class DrainGuard:
    """Answers new generation requests with `503 draining` while the app drains."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
        owner: Any = scope.get("app")
        if path not in GENERATION_PATHS or owner is None or drain_of(owner) is None:
            await self.app(scope, receive, send)
            return
        tracker = request_tracker(scope)
        if tracker is not None:
            tracker.finish(Outcome.SHED)
        refusal = APIError(
            503,
            "the server is draining before a restart; retry shortly",
            type_="server_error",
            code="draining",
            headers={"Retry-After": RETRY_AFTER_SECONDS},
        )
        await error_response(refusal, path)(scope, receive, send)


def _report(app: FastAPI) -> dict[str, Any]:
    drain = drain_of(app)
    state = state_of(app)
    body: dict[str, Any] = {
        "draining": drain is not None,
        "since": drain.since if drain is not None else None,
    }
    if state is None:
        startup: Startup = app.state.dgpp_startup
        return {**body, "state": startup.phase, "running": 0, "waiting": 0}
    stats = state.engine.stats()
    return {**body, "state": "serving", "running": stats.running, "waiting": stats.waiting}


@router.post("/drain")
async def drain(request: Request) -> dict[str, Any]:
    """Stop admitting (idempotent: a second call keeps the first `since`); the requests left."""
    if drain_of(request.app) is None:
        setattr(request.app.state, DRAIN_KEY, Drain(since=time.time()))
    return _report(request.app)


@router.post("/undrain")
async def undrain(request: Request) -> dict[str, Any]:
    """Admit again."""
    setattr(request.app.state, DRAIN_KEY, None)
    return _report(request.app)


@router.get("/drain")
async def drain_status(request: Request) -> dict[str, Any]:
    return _report(request.app)


@router.get("/nodes")
async def nodes(request: Request) -> dict[str, Any]:
    """Every rank's node snapshot with its age in seconds (None for a rank not heard from)."""
    reader: NodesReader | None = getattr(request.app.state, NODES_KEY, None)
    snapshots = await run_in_threadpool(reader) if reader is not None else []
    now = time.time()
    return {"nodes": [_aged(snapshot, now) for snapshot in snapshots]}


@router.post("/reload")
async def reload(request: Request) -> dict[str, Any]:
    """Take the deployment's live knobs now: `{"applied": {key: [old, new]}}`; 409
    `restart_required` naming the keys a restart must apply (nothing is applied then), 400 for
    a deployment file that does not validate."""
    reloader: Reloader | None = getattr(request.app.state, RELOAD_KEY, None)
    if reloader is None:
        raise APIError(409, "this server has no deployment to reload", code="nothing_to_reload")
    try:
        applied = await run_in_threadpool(reloader)
    except DgppError as err:
        status = 409 if err.code in RELOAD_REFUSALS else 400
        raise APIError(status, err.message, code=err.code) from None
    return {"applied": applied}


def _aged(snapshot: dict[str, Any], now: float) -> dict[str, Any]:
    """Ages come from the publishing node's clock: a skewed clock shows as a wrong age, never a
    negative one."""
    taken = snapshot.get("time")
    fresh = isinstance(taken, int | float)
    return {**snapshot, "age_s": round(max(0.0, now - taken), 3) if fresh else None}
