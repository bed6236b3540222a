"""schemathesis over the console's routes, with a logged-in session and its CSRF token.

The console serves no /openapi.json (openapi_url=None), but `app.openapi()` still builds the
schema of every route. Cases are drawn from every operation and sent through schemathesis' own
in-process client (a requests session on the ASGI app) carrying the session cookie and the
`X-CSRF-Token` header, so form posts get past the CSRF check and reach their handlers. The bar:
no 5xx and no hang; refusals (401/403/404/409/422, redirects to the login page) are fine.
Budget `DGPP_FUZZ_EXAMPLES` cases in all (default 200), derandomized.

Excluded, and why: POST /logout ends the session every later case needs
(tests/webui/security/test_auth.py covers it); POST /login with drawn credentials only feeds the
login limiter, which test_auth.py covers. Model pulls run against a pull function that fails at
once, since a fuzz test must not reach the network.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from schemathesis.python.asgi import ASGIClient

from dgpp.webui.models.pull import PullManager
from tests.engine.server.fuzz_checks import fuzz_examples
from tests.webui.conftest import Console, running_console

EXCLUDED = frozenset({"POST /logout", "POST /login"})
BASE_URL = "http://127.0.0.1"  # the console answers loopback clients
TIMEOUT_S = 10.0


def _no_network(*args: Any, **kwargs: Any) -> Path:
    raise ConnectionError("no network in the fuzz test")


@pytest.fixture(scope="module")
def console(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Console]:
    with running_console(tmp_path_factory.mktemp("fuzz-console")) as running:
        assert running.login().status_code == 303
        running.app.state.console.pulls = PullManager(pull=_no_network)
        yield running


@pytest.fixture(scope="module")
def session(console: Console) -> ASGIClient:
    """A requests session on the console app with the logged-in cookie and the CSRF header.
    Not entered (`with`): the console's lifespan already runs under the TestClient."""
    client = ASGIClient(console.app, base_url=BASE_URL)
    client.headers["X-CSRF-Token"] = console.csrf()
    client.cookies.update(dict(console.client.cookies.items()))
    return client


@pytest.fixture(scope="module")
def operations(console: Console) -> list[Any]:
    schema = schemathesis.openapi.from_dict(console.app.openapi())
    every = [result.ok() for result in schema.get_all_operations()]
    return [op for op in every if op.label not in EXCLUDED]


def test_every_operation_is_reached(operations: list[Any]) -> None:
    labels = {op.label for op in operations}
    assert {"GET /api/overview", "GET /api/logs/{rank}", "POST /switch"} <= labels
    assert not labels & EXCLUDED


@settings(
    max_examples=fuzz_examples(200),
    derandomize=True,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
@given(data=st.data())
def test_no_console_route_answers_5xx(
    data: st.DataObject, operations: list[Any], session: ASGIClient, console: Console
) -> None:
    operation = data.draw(st.sampled_from(operations))
    case = data.draw(operation.as_strategy())
    try:
        response = case.call(base_url=BASE_URL, session=session, timeout=TIMEOUT_S)
    except requests.exceptions.Timeout:
        pytest.fail(f"{operation.label} hung past {TIMEOUT_S} s: {case.body!r}")
    event(f"{operation.label} {response.status_code // 100}xx")
    request = f"{case.method} {case.formatted_path} {case.query!r} {case.body!r}"
    assert response.status_code < 500, f"{request} -> {response.status_code} {response.text}"


@pytest.mark.parametrize(
    "path",
    [
        "/history/9223372036854775808",
        "/api/history/switches/9223372036854775808",
        "/history/deployments/switch-9223372036854775808-applied",
    ],
)
def test_a_switch_id_past_sqlite_integers_is_not_found(session: ASGIClient, path: str) -> None:
    """Found by the fuzzer: a switch id of 2**63 reached SQLite: OverflowError, a 500."""
    assert session.get(path, timeout=TIMEOUT_S).status_code == 404
