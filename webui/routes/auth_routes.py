"""GET/POST /login and POST /logout.

The login form is protected against cross-site posting like every other form: GET /login sets a
random token in a short-lived cookie and in the form, and POST /login wants both to match.
Failed attempts are throttled per client address and per user name; the log records failures
with the address only (a password typed into the name field must not land in the log)."""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
from typing import Annotated

from fastapi import APIRouter, Depends, Form, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from dgpp.engine.errors import ConfigError
from dgpp.webui.routes.deps import ConsoleDep, check_csrf
from dgpp.webui.routes.pages import render
from dgpp.webui.security.sessions import LOGIN_COOKIE, SESSION_COOKIE

log = logging.getLogger(__name__)
router = APIRouter()

LOGIN_TOKEN_AGE_S = 3600


def _safe_next(target: str | None) -> str:
    """Only a path on this console: never another host (`//evil`, `https://...`)."""
    if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return "/"
    return target


def _login_page(
    request: Request, next_: str, message: str | None = None, status_code: int = 200
) -> HTMLResponse:
    token = secrets.token_urlsafe(32)
    response = render(
        request,
        "login.html",
        {"next": _safe_next(next_), "message": message, "login_token": token},
        status_code=status_code,
    )
    response.set_cookie(
        LOGIN_COOKIE,
        token,
        max_age=LOGIN_TOKEN_AGE_S,
        path="/login",
        httponly=True,
        samesite="strict",
        secure=request.app.state.console.config.secure_cookie,
    )
    return response


@router.get("/login", response_model=None)
async def login_form(request: Request, console: ConsoleDep, next: str = "/") -> Response:
    if console.sessions.get(request.cookies.get(SESSION_COOKIE), console.credentials_tag()):
        return RedirectResponse(_safe_next(next), status_code=303)
    return _login_page(request, next)


@router.post("/login", response_model=None)
async def login(
    request: Request,
    console: ConsoleDep,
    username: Annotated[str, Form()] = "",
    password: Annotated[str, Form()] = "",
    csrf_token: Annotated[str, Form()] = "",
    next: Annotated[str, Form()] = "/",
) -> Response:
    expected = request.cookies.get(LOGIN_COOKIE, "")
    if not expected or not hmac.compare_digest(csrf_token.encode(), expected.encode()):
        return _login_page(request, next, "The form expired; please log in again.", 403)
    client = request.client.host if request.client else "unknown"
    wait = console.limiter.retry_after(client)  # per address: nobody locks a user name out
    if wait > 0:
        response = _login_page(
            request, next, f"Too many failed attempts; try again in {wait:.0f} s.", 429
        )
        response.headers["Retry-After"] = str(int(wait) + 1)
        return response
    try:
        tag = console.credentials_tag()  # before reading: a replacement meanwhile voids it
        credentials = console.credentials()
    except ConfigError as err:
        log.error("cannot check a login: %s", err.message)
        return _login_page(request, next, "The console has no credentials yet.", 503)
    if not await asyncio.to_thread(credentials.verify, username, password):
        console.limiter.failed(client)
        log.warning("failed console login from %s", client)
        return _login_page(request, next, "Wrong user name or password.", 401)
    console.limiter.succeeded(client)
    token, _ = console.sessions.create(credentials.username, tag)
    log.info("console login by %s from %s", credentials.username, client)
    response = RedirectResponse(_safe_next(next), status_code=303)
    response.set_cookie(
        SESSION_COOKIE,
        token,
        max_age=int(console.config.session_ttl_s),
        path="/",
        httponly=True,
        samesite="strict",
        secure=console.config.secure_cookie,
    )
    response.delete_cookie(LOGIN_COOKIE, path="/login")
    return response


@router.post("/logout", dependencies=[Depends(check_csrf)])
async def logout(request: Request, console: ConsoleDep) -> RedirectResponse:
    console.sessions.delete(request.cookies.get(SESSION_COOKIE))
    response = RedirectResponse("/login", status_code=303)
    response.delete_cookie(SESSION_COOKIE, path="/")
    return response
