"""Rendering the console's Jinja2 pages: every page gets the user, the session's CSRF token (for
its forms) and the navigation; autoescaping is on for every template."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import HTMLResponse
from fastapi.templating import Jinja2Templates

from dgpp.webui.security.sessions import CSRF_FIELD, Session

TEMPLATES_DIR = Path(__file__).parents[1] / "templates"
STATIC_DIR = Path(__file__).parents[1] / "static"
NAVIGATION = (
    ("overview", "/", "Overview"),
    ("models", "/models", "Models"),
    ("knobs", "/knobs", "Knobs"),
    ("history", "/history", "History"),
    ("logs", "/logs", "Logs"),
)

templates = Jinja2Templates(directory=str(TEMPLATES_DIR))


def when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, seconds = divmod(rest, 60)
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h {minutes}m"
    return f"{minutes}m {seconds}s" if minutes else f"{seconds}s"


def elapsed(seconds: float | None) -> str:
    """A short span (a switch) to the tenth of a second; a longer one as `duration` has it."""
    if seconds is None:
        return "-"
    return f"{seconds:.1f} s" if seconds < 60 else duration(seconds)


templates.env.filters["when"] = when
templates.env.filters["duration"] = duration
templates.env.filters["elapsed"] = elapsed


def render(
    request: Request,
    name: str,
    context: dict[str, Any],
    session: Session | None = None,
    status_code: int = 200,
) -> HTMLResponse:
    page = {
        "navigation": NAVIGATION,
        "user": session.username if session is not None else None,
        "csrf_field": CSRF_FIELD,
        "csrf_token": session.csrf_token if session is not None else "",
        "now": time.time(),
        **context,
    }
    response = templates.TemplateResponse(request, name, page, status_code=status_code)
    response.headers["Cache-Control"] = "no-store"
    return response
