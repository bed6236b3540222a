"""POST /switch (apply a previewed deployment through the safe switch), GET /switch (its progress)
and GET /api/switch (the same as JSON, polled by the page)."""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Any

from fastapi import APIRouter, Form, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from dgpp.engine.errors import ConfigError
from dgpp.webui.deployments.knob_form import validation_errors
from dgpp.webui.deployments.store import resolve_raw
from dgpp.webui.routes.deps import (
    CSRF_CHECKED,
    LOGGED_IN,
    Backend,
    ConsoleDep,
    CurrentSession,
    EngineFor,
)
from dgpp.webui.routes.pages import render
from dgpp.webui.switch.switcher import SwitchBusyError

router = APIRouter(dependencies=LOGGED_IN)


def _refusal(request: Request, session: CurrentSession, message: str, status: int) -> Response:
    context = {"page": "switch", "job": None, "history": [], "error": message}
    return render(request, "switch.html", context, session, status_code=status)


@router.post("/switch", response_model=None, dependencies=CSRF_CHECKED)
async def start_switch(
    request: Request,
    console: ConsoleDep,
    backend: Backend,
    engine_for: EngineFor,
    session: CurrentSession,
    deployment: Annotated[str, Form()],
    title: Annotated[str, Form()] = "Apply a deployment",
) -> Response:
    try:
        raw = json.loads(deployment)
    except json.JSONDecodeError as err:
        return _refusal(request, session, f"the deployment is not valid JSON: {err}", 400)
    if not isinstance(raw, dict):
        return _refusal(request, session, "the deployment must be a JSON object", 400)
    errors = validation_errors(raw)
    if errors:
        problems = "; ".join(f"{path or 'deployment'}: {text}" for path, text in errors.items())
        return _refusal(request, session, f"the deployment is invalid: {problems}", 400)
    # The preview ran the memory plan already (cached); a stale page or a hand-made POST must not
    # drain and restart into a refusal either.
    plan = await asyncio.to_thread(console.plans.plan, resolve_raw(raw, "the new deployment"))
    if plan.verdict == "refused":
        message = f"the memory plan refuses it: {plan.message}"
        return _refusal(request, session, message, 400)
    try:
        console.switcher.begin(title[:200], raw, backend, engine_for, who=session.username)
    except SwitchBusyError as err:
        return _refusal(request, session, str(err), 409)
    except ConfigError as err:
        return _refusal(request, session, err.message, 400)
    return RedirectResponse("/switch", status_code=303)


@router.get("/switch", response_class=HTMLResponse)
async def switch_page(
    request: Request, console: ConsoleDep, session: CurrentSession
) -> HTMLResponse:
    history = list(reversed(console.switcher.history))
    context = {"page": "switch", "job": console.switcher.latest, "history": history[1:]}
    return render(request, "switch.html", context, session)


@router.get("/api/switch")
async def switch_json(console: ConsoleDep) -> dict[str, Any]:
    job = console.switcher.latest
    return {"busy": console.switcher.is_busy, "job": job.as_json() if job is not None else None}
