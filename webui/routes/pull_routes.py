"""POST /models/pull (start pulling a checkpoint from the Hugging Face hub, in the background),
POST /models/pull/cancel (stop it; nothing half-downloaded is kept) and GET /api/models/pulls
(every pull's phase and bytes, polled by the Models page's progress bars)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Form, Request
from fastapi.responses import RedirectResponse, Response

from dgpp.webui.models.pull import PullBusyError, PullRefusedError
from dgpp.webui.routes.deps import CSRF_CHECKED, LOGGED_IN, ConsoleDep, CurrentSession
from dgpp.webui.routes.model_routes import models_page, weights_dir

router = APIRouter(dependencies=LOGGED_IN)


@router.post("/models/pull", response_model=None, dependencies=CSRF_CHECKED)
async def start_pull(
    request: Request,
    console: ConsoleDep,
    session: CurrentSession,
    repo: Annotated[str, Form()] = "",
) -> Response:
    repo = repo.strip()
    try:
        console.pulls.start(repo, weights_dir(console))
    except PullRefusedError as err:
        return await models_page(request, console, session, 400, error=str(err))
    except PullBusyError as err:
        return await models_page(request, console, session, 409, error=str(err))
    return RedirectResponse("/models#downloads", status_code=303)


@router.post("/models/pull/cancel", response_model=None, dependencies=CSRF_CHECKED)
async def cancel_pull(
    request: Request,
    console: ConsoleDep,
    session: CurrentSession,
    repo: Annotated[str, Form()] = "",
) -> Response:
    if console.pulls.cancel(repo.strip()) is None:
        message = f"no pull of {repo.strip() or '(no repo)'} is running"
        return await models_page(request, console, session, 409, error=message)
    return RedirectResponse("/models#downloads", status_code=303)


@router.get("/api/models/pulls")
async def pulls(console: ConsoleDep) -> dict[str, Any]:
    return {"pulls": [job.as_json() for job in console.pulls.jobs()]}
