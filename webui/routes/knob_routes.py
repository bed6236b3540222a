"""GET /knobs (the form generated from the deployment schema) and POST /knobs/preview (server-side
validation with every field's error at once, the memory plan of the result among them; when all
is valid, what would change and the plan; applying is POST /switch)."""

from __future__ import annotations

import asyncio
import json

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from dgpp.appliance.deployments.diff import diff
from dgpp.engine.errors import ConfigError
from dgpp.webui.deployments.knob_form import apply_form, current_values, knob_fields, sections
from dgpp.webui.deployments.store import resolve_raw
from dgpp.webui.plans.memory_preview import MemoryPreview
from dgpp.webui.routes.deps import CSRF_CHECKED, LOGGED_IN, ConsoleDep, CurrentSession
from dgpp.webui.routes.pages import render

router = APIRouter(dependencies=LOGGED_IN)


def _form_page(
    request: Request,
    session: CurrentSession,
    values: dict[str, str],
    errors: dict[str, str],
    status_code: int = 200,
    plan: MemoryPreview | None = None,
) -> HTMLResponse:
    fields = knob_fields()
    paths = {field.path for field in fields}
    # Problems of no field on the form (a key only the file has, a whole section) show on top.
    general = [errors[""]] if "" in errors else []
    general += [f"{path}: {text}" for path, text in errors.items() if path and path not in paths]
    context = {
        "page": "knobs",
        "sections": sections(fields),
        "values": values,
        "errors": errors,
        "general_error": "; ".join(general),
        "plan": plan,
    }
    return render(request, "knobs.html", context, session, status_code=status_code)


@router.get("/knobs", response_class=HTMLResponse)
async def knobs_page(
    request: Request, console: ConsoleDep, session: CurrentSession
) -> HTMLResponse:
    try:
        current = current_values(console.store.current())
    except ConfigError as err:
        return _form_page(request, session, {}, {"": err.message}, status_code=500)
    values = {field.path: field.text(current[field.path]) for field in knob_fields()}
    return _form_page(request, session, values, {})


@router.post("/knobs/preview", response_class=HTMLResponse, dependencies=CSRF_CHECKED)
async def preview_knobs(
    request: Request, console: ConsoleDep, session: CurrentSession
) -> HTMLResponse:
    form = await request.form()
    posted = {key: value for key, value in form.items() if isinstance(value, str)}
    try:
        raw = console.store.read_raw()
        current = console.store.current()
    except ConfigError as err:
        return _form_page(request, session, posted, {"": err.message}, status_code=500)
    result = apply_form(posted, raw, current)
    errors = dict(result.errors)
    plan = None
    if result.checked is not None:  # what passes every other check: does it fit?
        plan = await asyncio.to_thread(console.plans.plan, result.checked)
        if plan.verdict == "refused":
            field = plan.field if plan.field in {f.path for f in knob_fields()} else ""
            message = f"the memory plan refuses it: {plan.message}"
            errors[field] = f"{errors[field]}; {message}" if field in errors else message
    if errors:
        return _form_page(request, session, result.values, errors, status_code=400, plan=plan)
    new = resolve_raw(result.raw, "the new deployment")
    return render(
        request,
        "preview.html",
        {
            "page": "knobs",
            "title": "Apply knobs",
            "changes": diff(current, new),
            "deployment_json": json.dumps(result.raw),
            "back": "/knobs",
            "busy": console.switcher.is_busy,
            "plan": plan,
        },
        session,
    )
