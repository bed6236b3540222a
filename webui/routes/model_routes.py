"""GET /models (installed checkpoints and shipped templates, each with what a switch to it would
mean: current, downloaded, size, fit, served names), GET /api/models/fits (the memory plans as
they are computed, polled by the page) and POST /models/preview (validate another model, draw
its memory plan and show what would change; refused with the numbers when it does not fit;
applying it is POST /switch)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Form, Request
from fastapi.responses import HTMLResponse

from dgpp.appliance.deployments.deployment import Deployment
from dgpp.appliance.deployments.diff import diff
from dgpp.engine.errors import ConfigError, DgppError
from dgpp.webui.core.console import Console
from dgpp.webui.deployments.edit import with_model, with_template
from dgpp.webui.deployments.store import resolve_raw, served_names
from dgpp.webui.models.catalogue import Catalogue, renames
from dgpp.webui.routes.deps import CSRF_CHECKED, LOGGED_IN, ConsoleDep, CurrentSession, EngineFor
from dgpp.webui.routes.pages import render
from dgpp.webui.routes.side_model_routes import side_rows

router = APIRouter(dependencies=LOGGED_IN)


def check_model(deployment: Deployment) -> str | None:
    """Why rank 0 could not load the deployment's model (looking only on this machine, the
    weights directory first, as a rank does), or None."""
    from dgpp.appliance.deployments.deployment import checkpoint_of
    from dgpp.engine.checkpoint.config import ModelConfig
    from dgpp.engine.models.registry import model_class

    try:
        model_class(ModelConfig.from_checkpoint(checkpoint_of(deployment)))
    except DgppError as err:
        return err.message
    except (OSError, ValueError) as err:
        return f"cannot read the checkpoint {deployment.model}: {err}"
    return None


def weights_dir(console: Console) -> Path | None:
    """Where pulls land: the current deployment's weights directory, if it names one."""
    try:
        configured = console.store.current().paths.models_dir
    except ConfigError:
        return None
    return Path(configured).expanduser() if configured else None


def _catalogue(
    console: Console, schedule: Callable[[str], bool] = lambda key: False
) -> tuple[Catalogue, str | None]:
    """The page's rows, and why the current deployment cannot be read (None when it can)."""
    raw: dict[str, Any] = {}
    try:
        raw = console.store.read_raw()
        current: Deployment | None = resolve_raw(raw, str(console.store.path))
    except ConfigError as err:
        return Catalogue(raw, None, console.plans, schedule), err.message
    return Catalogue(raw, current, console.plans, schedule), None


def _page_context(console: Console) -> dict[str, Any]:
    catalogue, error = _catalogue(console)
    rows = catalogue.candidates()
    target = weights_dir(console)
    jobs = console.pulls.jobs()
    return {
        "page": "models",
        "checkpoints": [row for row in rows if row.kind == "checkpoint"],
        "incomplete": [entry for entry in catalogue.checkpoints if not entry.is_complete],
        "templates": [row for row in rows if row.kind == "template"],
        "current": catalogue.current,
        # The served-name consequence, said once above the tables (rows only carry a mark).
        "served_now": served_names(catalogue.current) if catalogue.current else (),
        "any_renames": any(row.renames for row in rows),
        "current_error": error,
        "switch": console.switcher.latest,
        "pulls": [job.as_json() for job in jobs],
        "pulling": {job.repo_id for job in jobs if job.is_running},
        "pull_target": str(target) if target is not None else "the Hugging Face cache",
    }


async def models_page(
    request: Request,
    console: Console,
    session: CurrentSession,
    status_code: int = 200,
    **extra: Any,
) -> HTMLResponse:
    """The Models page; `extra` (an error, the values typed) on top of its own context."""
    context = await asyncio.to_thread(_page_context, console)
    return render(request, "models.html", {**context, **extra}, session, status_code=status_code)


@router.get("/models", response_class=HTMLResponse)
async def models(
    request: Request,
    console: ConsoleDep,
    session: CurrentSession,
    engine_for: EngineFor,
    side_message: str = "",
) -> HTMLResponse:
    sides = await side_rows(console, engine_for)
    return await models_page(request, console, session, side_message=side_message, **sides)


@router.get("/api/models/fits")
async def model_fits(console: ConsoleDep, rows: str = "") -> dict[str, Any]:
    """Every row's memory plan as known now (`checking` until it is computed); those not yet
    known are computed in the background: every row's, or those `rows` names (comma-separated
    keys, `template:NAME` / `checkpoint:NAME`)."""
    wanted = {key for key in rows.split(",") if key}

    def fits() -> dict[str, Any]:
        schedule = (lambda key: key in wanted) if wanted else (lambda key: True)
        candidates = _catalogue(console, schedule)[0].candidates()
        found = {row.key: row.fit_json() for row in candidates}
        pending = sum(1 for fit in found.values() if fit["fits"] == "checking")
        return {"rows": found, "pending": pending}

    return await asyncio.to_thread(fits)


@router.post("/models/preview", response_class=HTMLResponse, dependencies=CSRF_CHECKED)
async def preview_model(
    request: Request,
    console: ConsoleDep,
    session: CurrentSession,
    model: Annotated[str, Form()] = "",
    template: Annotated[str, Form()] = "",
    served_name: Annotated[str, Form()] = "",
) -> HTMLResponse:
    async def refuse(message: str) -> HTMLResponse:
        return await models_page(
            request,
            console,
            session,
            status_code=400,
            error=message,
            model_value=model,
            name_value=served_name,
        )

    model, template, served_name = model.strip(), template.strip(), served_name.strip()
    if bool(model) == bool(template):
        return await refuse("Choose either a model reference or a template.")
    try:
        raw = console.store.read_raw()
        current = console.store.current()
        if template:
            new_raw = with_template(raw, template)
        else:
            new_raw = with_model(raw, model, served_name or None)
        new = resolve_raw(new_raw, "the new deployment")
    except ConfigError as err:
        return await refuse(err.message)
    problem = await asyncio.to_thread(check_model, new)
    if problem is not None:
        return await refuse(problem)
    plan = await asyncio.to_thread(console.plans.plan, new)
    return render(
        request,
        "preview.html",
        {
            "page": "models",
            "title": f"Switch to {template or model}",
            "changes": diff(current, new),
            "deployment_json": json.dumps(new_raw),
            "back": "/models",
            "busy": console.switcher.is_busy,
            "plan": plan,
            "renames": renames(current, served_names(new)),
        },
        session,
        status_code=400 if plan.verdict == "refused" else 200,
    )
