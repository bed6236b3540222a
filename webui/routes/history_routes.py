"""The change history: GET /history (every recorded switch, and the earlier deployment files the
console kept), GET /history/{id} (one switch), GET /history/deployments/{ref} (one earlier
deployment file) and GET /history/deployments/{ref}/restore (what restoring it would change).

A restore is a preview like any other: validated as any switch is, its memory plan drawn, applied
through POST /switch (the safe switch, with its CSRF token and its rollback). Nothing here
changes state.

An earlier deployment is named by a ref: `switch-{id}-applied` or `switch-{id}-replaced` (the
file a switch wrote, or the one it replaced, from the switch log) or the name of a file kept
under `<state_dir>/deployments` (`deployment-20261202-041834-123456789`)."""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from dgpp.appliance.deployments.diff import diff
from dgpp.engine.errors import ConfigError
from dgpp.webui.core.console import Console
from dgpp.webui.deployments.knob_form import validation_errors
from dgpp.webui.deployments.store import resolve_raw
from dgpp.webui.routes.deps import LOGGED_IN, ConsoleDep, CurrentSession
from dgpp.webui.routes.pages import render, when

router = APIRouter(dependencies=LOGGED_IN)

LISTED_SWITCHES = 200
_SWITCH_REF = re.compile(r"switch-(?P<ident>\d+)-(?P<which>applied|replaced)")


@dataclass(frozen=True)
class EarlierDeployment:
    ref: str
    label: str  # "the deployment switch 3 replaced"
    text: str  # the file's content


def earlier_deployment(console: Console, ref: str) -> EarlierDeployment | None:
    """The deployment file `ref` names (see the module's docstring); None when it names none."""
    match = _SWITCH_REF.fullmatch(ref)
    if match is not None:
        job = console.switcher.journal.get(int(match["ident"]))
        text = "" if job is None else getattr(job, match["which"])
        label = f"the deployment switch {match['ident']} {match['which']}"
        return EarlierDeployment(ref, label, text) if text else None
    text = console.store.read_kept(ref)
    if text is None:
        return None
    kept = next((kept for kept in console.store.kept() if kept.name == ref), None)
    replaced = f", replaced {when(kept.replaced_at)}" if kept is not None else ""
    return EarlierDeployment(ref, f"the kept file {ref}.json{replaced}", text)


def _not_found(
    request: Request, session: CurrentSession, template: str, message: str
) -> HTMLResponse:
    context = {"page": "history", "error": message}
    return render(request, template, context, session, status_code=404)


def _no_deployment(request: Request, session: CurrentSession, ref: str) -> HTMLResponse:
    message = f"no earlier deployment named {ref}"
    return _not_found(request, session, "history_deployment.html", message)


@router.get("/history", response_class=HTMLResponse)
async def history_page(
    request: Request, console: ConsoleDep, session: CurrentSession
) -> HTMLResponse:
    context = {
        "page": "history",
        "switches": console.switcher.journal.recent(LISTED_SWITCHES),
        "kept": console.store.kept(),
        "busy": console.switcher.is_busy,
    }
    return render(request, "history.html", context, session)


@router.get("/history/{ident}", response_class=HTMLResponse)
async def switch_detail(
    request: Request, console: ConsoleDep, session: CurrentSession, ident: int
) -> HTMLResponse:
    job = console.switcher.journal.get(ident)
    if job is None:
        return _not_found(
            request, session, "history_detail.html", f"no switch {ident} in the history"
        )
    context = {"page": "history", "job": job, "error": None}
    return render(request, "history_detail.html", context, session)


@router.get("/history/deployments/{ref}", response_class=HTMLResponse)
async def deployment_page(
    request: Request, console: ConsoleDep, session: CurrentSession, ref: str
) -> HTMLResponse:
    earlier = earlier_deployment(console, ref)
    if earlier is None:
        return _no_deployment(request, session, ref)
    context = {"page": "history", "deployment": earlier, "pretty": _pretty(earlier.text)}
    return render(request, "history_deployment.html", context, session)


@router.get("/history/deployments/{ref}/restore", response_class=HTMLResponse)
async def restore_preview(
    request: Request, console: ConsoleDep, session: CurrentSession, ref: str
) -> HTMLResponse:
    """What restoring `ref` would change; refused, with every problem, when it is invalid."""
    earlier = earlier_deployment(console, ref)
    if earlier is None:
        return _no_deployment(request, session, ref)
    problems, raw = _restorable(earlier.text)
    try:
        current = console.store.current()
        new = resolve_raw(raw, earlier.label) if not problems else None
    except ConfigError as err:
        problems, new = [err.message], None
    if new is None:
        context = {
            "page": "history",
            "deployment": earlier,
            "pretty": _pretty(earlier.text),
            "problems": problems,
        }
        return render(request, "history_deployment.html", context, session, status_code=400)
    plan = await asyncio.to_thread(console.plans.plan, new)  # does it still fit here?
    return render(
        request,
        "preview.html",
        {
            "page": "history",
            "title": f"Restore {earlier.label}",
            "changes": diff(current, new),
            "deployment_json": json.dumps(raw),
            "back": f"/history/deployments/{earlier.ref}",
            "busy": console.switcher.is_busy,
            "plan": plan,
        },
        session,
        status_code=400 if plan.verdict == "refused" else 200,
    )


@router.get("/api/history/switches")
async def switches_json(console: ConsoleDep) -> dict[str, Any]:
    jobs = console.switcher.journal.recent(LISTED_SWITCHES)
    return {"busy": console.switcher.is_busy, "switches": [job.as_json() for job in jobs]}


@router.get("/api/history/switches/{ident}", response_model=None)
async def switch_json(console: ConsoleDep, ident: int) -> dict[str, Any] | Response:
    job = console.switcher.journal.get(ident)
    if job is None:
        return JSONResponse({"error": f"no switch {ident} in the history"}, status_code=404)
    return {**job.as_json(), "applied": job.applied, "replaced": job.replaced}


def _restorable(text: str) -> tuple[list[str], dict[str, Any]]:
    """(what refuses `text` as a deployment, its content): the checks POST /switch makes."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as err:
        return [f"not valid JSON: {err}"], {}
    if not isinstance(raw, dict):
        return ["a deployment must be a JSON object"], {}
    errors = validation_errors(raw)
    return [f"{path or 'deployment'}: {message}" for path, message in errors.items()], raw


def _pretty(text: str) -> str:
    """`text` indented for reading; as it is when it is not JSON (the page says why)."""
    try:
        return json.dumps(json.loads(text), indent=2)
    except json.JSONDecodeError:
        return text
