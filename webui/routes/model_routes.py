"""GET /models (installed checkpoints and shipped templates) and POST /models/preview (validate
another model and show what would change; applying it is POST /switch)."""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Any

from fastapi import APIRouter, Form, Request
from fastapi.responses import HTMLResponse

from dgpp.appliance.deployment_files import list_templates
from dgpp.engine.errors import ConfigError, DgppError
from dgpp.webui.console import Console
from dgpp.webui.deployment_edit import diff, with_model, with_template
from dgpp.webui.deployment_store import resolve_raw
from dgpp.webui.deps import CSRF_CHECKED, LOGGED_IN, ConsoleDep, CurrentSession
from dgpp.webui.pages import render

router = APIRouter(dependencies=LOGGED_IN)


def check_model(reference: str) -> str | None:
    """Why rank 0 could not load `reference` (looking only on this machine), or None."""
    from dgpp.appliance.model_store import resolve_model
    from dgpp.engine.config import ModelConfig
    from dgpp.engine.models.registry import model_class

    try:
        model_class(ModelConfig.from_checkpoint(resolve_model(reference)))
    except DgppError as err:
        return err.message
    except (OSError, ValueError) as err:
        return f"cannot read the checkpoint {reference}: {err}"
    return None


def _catalogue(console: Console) -> dict[str, Any]:
    from dgpp.appliance.model_store import list_models

    templates = []
    for template in list_templates():
        try:
            raw = template.load()
        except ConfigError:
            continue
        templates.append(
            {"name": template.name, "model": raw.get("model"), "world": raw.get("world_size", 1)}
        )
    try:
        current: Any = console.store.current()
    except ConfigError as err:
        current = None
        error = err.message
    else:
        error = None
    return {
        "page": "models",
        "checkpoints": list_models(),
        "templates": templates,
        "current": current,
        "current_error": error,
        "switch": console.switcher.latest,
    }


@router.get("/models", response_class=HTMLResponse)
async def models_page(
    request: Request, console: ConsoleDep, session: CurrentSession
) -> HTMLResponse:
    catalogue = await asyncio.to_thread(_catalogue, console)
    return render(request, "models.html", catalogue, session)


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
        catalogue = await asyncio.to_thread(_catalogue, console)
        context = {**catalogue, "error": message, "model_value": model, "name_value": served_name}
        return render(request, "models.html", context, session, status_code=400)

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
    problem = await asyncio.to_thread(check_model, new.model)
    if problem is not None:
        return await refuse(problem)
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
        },
        session,
    )
