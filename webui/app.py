"""`create_app(config)`: the console's FastAPI application.

Every page and API route needs a logged-in session (only `/login` and the static files do not);
every state-changing request needs the session's CSRF token. Responses carry a strict Content
Security Policy: scripts and styles come from `/static` only, nothing leaves the host."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from urllib.parse import quote

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles

from dgpp.appliance.control.backend import ControlBackend
from dgpp.webui.core.config import ConsoleConfig
from dgpp.webui.core.console import Console, build_console
from dgpp.webui.monitor.metrics_poller import MetricsPoller
from dgpp.webui.routes import (
    auth_routes,
    doctor_routes,
    history_routes,
    knob_routes,
    log_routes,
    model_routes,
    overview_routes,
    pull_routes,
    side_model_routes,
    switch_routes,
)
from dgpp.webui.routes.deps import (
    CsrfRefusedError,
    LoginRequiredError,
    get_engine_factory,
    resolved,
)
from dgpp.webui.routes.pages import STATIC_DIR

log = logging.getLogger(__name__)

SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
}


def _is_api(request: Request) -> bool:
    return request.url.path.startswith("/api/")


def _warm(console: Console) -> None:
    """Every Models row's memory plan, queued in the background at start (`warm_plans`)."""
    from dgpp.webui.models.catalogue import warm_plans
    from dgpp.webui.plans import worker_pool

    try:
        rows = warm_plans(console.store.read_raw(), console.plans)
    except Exception:  # the page computes them on demand; this is an optimisation
        log.exception("queueing the memory plans of the Models page failed")
        return
    finally:
        worker_pool.release_early()  # every plan stored: the early workers are not needed
    log.info("computing the memory plans of %d models and templates in the background", rows)


def create_app(config: ConsoleConfig, backend: ControlBackend | None = None) -> FastAPI:
    """The console. `backend` replaces the one the settings name (tests pass fakes)."""
    from dgpp.webui.core.engine_address import check_engine_url

    # Before anything is built: a console that would start one engine and watch another refuses.
    check_engine_url(config, backend.kind if backend is not None else config.backend)
    console = build_console(config, backend)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tasks = []
        if config.autostart and console.backend.kind == "local":
            result = await asyncio.to_thread(console.backend.start)
            log.info("%s", result.message)
        if config.warm_plans:
            warm = threading.Thread(target=_warm, args=(console,), name="dgpp-webui-warm")
            warm.daemon = True
            warm.start()
        if config.sample_interval_s > 0:
            sampler = MetricsPoller(
                console.history,
                lambda: resolved(app, get_engine_factory, console.engine_for)(
                    console.store.current()
                ),
                config.sample_interval_s,
            )
            tasks.append(asyncio.create_task(sampler.run(), name="dgpp-webui-sampler"))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if config.autostart and console.backend.kind == "local":
                result = await asyncio.to_thread(console.backend.stop)
                log.info("%s", result.message)
            console.history.close()
            console.sessions.close()
            console.switcher.journal.close()
            console.pulls.close()  # a download cut short leaves nothing behind
            console.plans.close()

    app = FastAPI(
        title="dgpp console", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.console = console
    app.mount("/static", StaticFiles(directory=str(STATIC_DIR)), name="static")
    for module in (
        auth_routes,
        overview_routes,
        doctor_routes,
        model_routes,
        side_model_routes,
        pull_routes,
        knob_routes,
        switch_routes,
        history_routes,
        log_routes,
    ):
        app.include_router(module.router)

    @app.exception_handler(LoginRequiredError)
    async def _login_required(request: Request, _: LoginRequiredError) -> Response:
        if _is_api(request) or request.method != "GET":
            return JSONResponse({"error": "login required"}, status_code=401)
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        return RedirectResponse(f"/login?next={quote(target, safe='')}", status_code=303)

    @app.exception_handler(CsrfRefusedError)
    async def _csrf_refused(request: Request, _: CsrfRefusedError) -> Response:
        message = "missing or wrong CSRF token; reload the page and try again"
        if _is_api(request):
            return JSONResponse({"error": message}, status_code=403)
        return PlainTextResponse(message, status_code=403)

    @app.middleware("http")
    async def _headers(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        response = await call_next(request)
        for name, value in SECURITY_HEADERS.items():
            response.headers.setdefault(name, value)
        return response

    return app


def console_of(app: FastAPI) -> Console:
    return app.state.console
