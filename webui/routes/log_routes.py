"""GET /logs (a rank's log tail), GET /api/logs/{rank} (the same, refreshed by the page) and
POST /logs/bundle (a support bundle of the current deployment, secrets redacted).

Both log routes take `lines` (how many of the latest lines), `run` (an earlier run from the
backend's `log_runs`; none: the latest lines) and `q`: only the lines of those that contain it,
case folded, are returned, with how many matched."""

from __future__ import annotations

import asyncio
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi import Path as PathParam
from fastapi.responses import (
    FileResponse,
    HTMLResponse,
    JSONResponse,
    PlainTextResponse,
    Response,
)
from starlette.background import BackgroundTask

from dgpp.appliance.control.backend import ControlBackend, LogRun
from dgpp.appliance.deployments.files import deployment_id
from dgpp.engine.errors import ConfigError
from dgpp.webui.core.console import Console
from dgpp.webui.routes.deps import CSRF_CHECKED, LOGGED_IN, Backend, ConsoleDep, CurrentSession
from dgpp.webui.routes.pages import render, when

router = APIRouter(dependencies=LOGGED_IN)

Lines = Annotated[int, Query(ge=1, le=5000)]
Rank = Annotated[int, Query(ge=0, le=63)]
RankInPath = Annotated[int, PathParam(ge=0, le=63)]
# "" is the run selector's "current": the latest lines, as when `run` is left out.
Run = Annotated[str, Query(max_length=64, pattern=r"^[0-9A-Za-z_.-]*$")]
Search = Annotated[str, Query(max_length=200)]


@dataclass(frozen=True)
class LogView:
    """What both routes answer: the lines shown and how many of the tail matched `q`."""

    text: str
    searched: int  # lines of the tail that were searched
    matched: int  # of those, the ones shown (all of them without `q`)


def search_lines(text: str, query: str) -> LogView:
    """The lines of `text` that contain `query` (case folded); all of them for an empty query."""
    lines = text.splitlines()
    if not query:
        return LogView(text, len(lines), len(lines))
    needle = query.casefold()
    found = [line for line in lines if needle in line.casefold()]
    return LogView("\n".join(found), len(lines), len(found))


def _world_size(console: Console) -> int:
    try:
        return console.store.current().world_size
    except ConfigError:
        return 1


def _run_options(runs: list[LogRun], run: str) -> list[dict[str, Any]]:
    """The run selector: the current run as "" (the latest lines), then the earlier ones."""
    options = [{"value": "", "label": "current", "selected": run == ""}]
    for listed in runs:
        started = when(listed.started_at) if listed.started_at else None
        if listed.is_current:
            options[0]["label"] = f"current (since {started})" if started else "current"
            options[0]["selected"] = options[0]["selected"] or listed.id == run
        else:
            label = started or f"run {listed.id}"
            options.append({"value": listed.id, "label": label, "selected": listed.id == run})
    return options


async def _read(
    backend: ControlBackend, rank: int, lines: int, run: str, query: str, runs: list[LogRun]
) -> LogView | None:
    """The view; None for a run that is not among `runs` (the backend's `log_runs`)."""
    if run and run not in {listed.id for listed in runs}:
        return None
    text = await asyncio.to_thread(backend.log_tail, rank, lines, run or None)
    return search_lines(text, query)


@router.get("/logs", response_class=HTMLResponse)
async def logs_page(
    request: Request,
    console: ConsoleDep,
    backend: Backend,
    session: CurrentSession,
    rank: Rank = 0,
    lines: Lines = 200,
    run: Run = "",
    q: Search = "",
) -> HTMLResponse:
    runs = await asyncio.to_thread(backend.log_runs, rank)
    view = await _read(backend, rank, lines, run, q, runs)
    context = {
        "page": "logs",
        "ranks": list(range(max(_world_size(console), rank + 1))),
        "rank": rank,
        "lines": lines,
        "run": run,
        "runs": _run_options(runs, run),
        "q": q,
        "view": view,
    }
    response = render(request, "logs.html", context, session)
    if view is None:
        response.status_code = 404
    return response


@router.get("/api/logs/{rank}", response_model=None)
async def log_tail(
    rank: RankInPath, backend: Backend, lines: Lines = 200, run: Run = "", q: Search = ""
) -> dict[str, Any] | JSONResponse:
    # The page follows the latest lines every 2 s: list the runs only to check an earlier one.
    runs = await asyncio.to_thread(backend.log_runs, rank) if run else []
    view = await _read(backend, rank, lines, run, q, runs)
    if view is None:
        return JSONResponse({"error": f"rank {rank} has no run {run!r}"}, status_code=404)
    return {
        "rank": rank,
        "lines": lines,
        "run": run,
        "q": q,
        "text": view.text,
        "searched": view.searched,
        "matched": view.matched,
    }


@router.post("/logs/bundle", response_model=None, dependencies=CSRF_CHECKED)
async def support_bundle(console: ConsoleDep) -> Response:
    from dgpp.appliance.deployments.support_bundle import write_bundle

    folder = Path(tempfile.mkdtemp(prefix="dgpp-bundle-", dir=console.config.state_dir))
    try:
        ident = deployment_id(console.store.current())
        path = await asyncio.to_thread(write_bundle, ident, folder / f"dgpp-support-{ident}.tar.gz")
    except ConfigError as err:
        folder.rmdir()
        return PlainTextResponse(f"no support bundle: {err.message}", status_code=404)

    def remove() -> None:
        path.unlink(missing_ok=True)
        folder.rmdir()

    return FileResponse(
        path, media_type="application/gzip", filename=path.name, background=BackgroundTask(remove)
    )
