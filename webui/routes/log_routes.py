"""GET /logs (a rank's log tail), GET /api/logs/{rank} (the same, refreshed by the page) and
POST /logs/bundle (a support bundle of the current deployment, secrets redacted)."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, HTMLResponse, PlainTextResponse, Response
from starlette.background import BackgroundTask

from dgpp.appliance.deployment_files import deployment_id
from dgpp.engine.errors import ConfigError
from dgpp.webui.console import Console
from dgpp.webui.deps import CSRF_CHECKED, LOGGED_IN, Backend, ConsoleDep, CurrentSession
from dgpp.webui.pages import render

router = APIRouter(dependencies=LOGGED_IN)

Lines = Annotated[int, Query(ge=1, le=5000)]
Rank = Annotated[int, Query(ge=0, le=63)]


def _world_size(console: Console) -> int:
    try:
        return console.store.current().world_size
    except ConfigError:
        return 1


@router.get("/logs", response_class=HTMLResponse)
async def logs_page(
    request: Request,
    console: ConsoleDep,
    backend: Backend,
    session: CurrentSession,
    rank: Rank = 0,
    lines: Lines = 200,
) -> HTMLResponse:
    text = await asyncio.to_thread(backend.log_tail, rank, lines)
    context = {
        "page": "logs",
        "ranks": list(range(max(_world_size(console), rank + 1))),
        "rank": rank,
        "lines": lines,
        "text": text,
    }
    return render(request, "logs.html", context, session)


@router.get("/api/logs/{rank}")
async def log_tail(rank: int, backend: Backend, lines: Lines = 200) -> dict[str, Any]:
    text = await asyncio.to_thread(backend.log_tail, rank, lines)
    return {"rank": rank, "lines": lines, "text": text}


@router.post("/logs/bundle", response_model=None, dependencies=CSRF_CHECKED)
async def support_bundle(console: ConsoleDep) -> Response:
    from dgpp.appliance.support_bundle import write_bundle

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
