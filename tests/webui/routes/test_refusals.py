"""Every state-changing route refuses a request without a session (401) and one without the
session's CSRF token (403), and changes nothing either way. The routes are read from the app, so
a new one cannot slip through untested."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.routing import APIRoute

from tests.webui.conftest import DEPLOYMENT, Console

# One body per state-changing route that would succeed with the right token.
VALID_FORMS = {
    "/logout": {},
    "/models/preview": {"model": "/models/other", "served_name": "other"},
    "/knobs/preview": {"engine.kv_capacity": "4096"},
    "/models/pull": {"repo": "org/other"},
    "/models/pull/cancel": {"repo": "org/other"},
    "/models/side/{name}/{action}": {},
    "/switch": {"deployment": json.dumps({**DEPLOYMENT, "model": "/models/other"})},
    "/logs/bundle": {},
}


def _api_routes(routes: list[Any]) -> list[APIRoute]:
    """Every endpoint, inside included routers too (the console's routers have no prefix)."""
    found = []
    for route in routes:
        if isinstance(route, APIRoute):
            found.append(route)
        elif hasattr(route, "original_router"):  # FastAPI's wrapper of an included router
            found += _api_routes(route.original_router.routes)
    return found


def _state_changing(console: Console) -> list[str]:
    return sorted(
        route.path
        for route in _api_routes(console.app.routes)
        if route.methods - {"GET", "HEAD"}
        if route.path != "/login"  # before any session; its own token is tested in test_auth
    )


def test_the_table_covers_every_state_changing_route(console: Console) -> None:
    assert _state_changing(console) == sorted(VALID_FORMS)


@pytest.mark.parametrize("path", sorted(VALID_FORMS))
def test_without_a_session_nothing_happens(console: Console, path: str) -> None:
    before = console.config.deployment.read_text()
    response = console.client.post(path, data=VALID_FORMS[path], follow_redirects=False)
    assert response.status_code == 401
    assert console.world.actions == []
    assert console.config.deployment.read_text() == before


@pytest.mark.parametrize("token", [None, "", "forged-token"])
@pytest.mark.parametrize("path", sorted(VALID_FORMS))
def test_without_the_csrf_token_nothing_happens(
    logged_in: Console, path: str, token: str | None
) -> None:
    before = logged_in.config.deployment.read_text()
    data = dict(VALID_FORMS[path])
    if token is not None:
        data["csrf_token"] = token
    response = logged_in.client.post(path, data=data, follow_redirects=False)
    assert response.status_code == 403, response.text
    assert "CSRF" in response.text
    assert logged_in.world.actions == []
    assert logged_in.config.deployment.read_text() == before
    assert logged_in.client.get("/api/switch").json()["job"] is None


def test_a_token_in_the_header_is_accepted_and_a_wrong_one_refused(logged_in: Console) -> None:
    token = logged_in.csrf()
    response = logged_in.client.post(
        "/knobs/preview", data={"engine.kv_capacity": "4096"}, headers={"X-CSRF-Token": "x"}
    )
    assert response.status_code == 403
    response = logged_in.client.post(
        "/knobs/preview", data={"engine.kv_capacity": "4096"}, headers={"X-CSRF-Token": token}
    )
    assert response.status_code == 200


def test_another_session_token_is_refused(console: Console) -> None:
    console.login()
    first = console.csrf()
    console.client.cookies.clear()
    console.login()
    response = console.client.post("/knobs/preview", data={"csrf_token": first})
    assert response.status_code == 403
