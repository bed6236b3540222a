"""Typed dependencies of the console's routes. Tests replace `get_backend` and
`get_engine_factory` through `app.dependency_overrides`; the sampler honours the same overrides.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request

from dgpp.appliance.control.backend import ControlBackend
from dgpp.webui.core.console import Console
from dgpp.webui.security.sessions import CSRF_FIELD, CSRF_HEADER, SESSION_COOKIE, Session
from dgpp.webui.switch.switcher import EngineFactory


class LoginRequiredError(Exception):
    """No valid session: pages redirect to the login form, API routes answer 401."""


class CsrfRefusedError(Exception):
    """A state-changing request without the session's CSRF token: 403."""


def get_console(request: Request) -> Console:
    return request.app.state.console


def get_backend(request: Request) -> ControlBackend:
    return get_console(request).backend


def get_engine_factory(request: Request) -> EngineFactory:
    return get_console(request).engine_for


def resolved(app: FastAPI, dependency: Callable[..., Any], default: Any) -> Any:
    """A dependency's value outside a request: the test's override when there is one."""
    override = app.dependency_overrides.get(dependency)
    return override() if override is not None else default


def get_session(request: Request) -> Session:
    console = get_console(request)
    session = console.sessions.get(request.cookies.get(SESSION_COOKIE), console.credentials_tag())
    if session is None:
        raise LoginRequiredError()
    return session


async def check_csrf(request: Request) -> None:
    """The session's CSRF token must come back in the `X-CSRF-Token` header or the form."""
    session = get_session(request)
    presented = request.headers.get(CSRF_HEADER)
    if presented is None and request.headers.get("content-type", "").startswith(
        ("application/x-www-form-urlencoded", "multipart/form-data")
    ):
        form = await request.form()
        value = form.get(CSRF_FIELD)
        presented = value if isinstance(value, str) else None
    if not presented or not hmac.compare_digest(presented.encode(), session.csrf_token.encode()):
        raise CsrfRefusedError()


ConsoleDep = Annotated[Console, Depends(get_console)]
Backend = Annotated[ControlBackend, Depends(get_backend)]
EngineFor = Annotated[EngineFactory, Depends(get_engine_factory)]
CurrentSession = Annotated[Session, Depends(get_session)]
LOGGED_IN = [Depends(get_session)]
CSRF_CHECKED = [Depends(check_csrf)]
