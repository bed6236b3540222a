"""schemathesis over the engine's own OpenAPI schema, in process, on a scripted engine.

Every route in /openapi.json is fuzzed statelessly with schema-valid and schema-invalid requests
(schemathesis' positive and negative modes). The bar: no 5xx, no request that hangs, and every
4xx an error body in the API's shape (OpenAI's, or Anthropic's on /v1/messages) that, for a
validation error, names the offending field. The budget is `DGPP_FUZZ_EXAMPLES` examples per
operation (default 25) under a fixed seed (`derandomize`), so CI replays the same requests. The
server also answers to the name pattern `*`, so a drawn `model` is served rather than every case
ending in 404 `model_not_found` before the request is looked at.

Nothing is excluded. The admin routes answer loopback clients only without an admin key, and
schemathesis' in-process client is not loopback, so the app has an admin key and the test sends
it; a case that drains the server is undone after it, since later cases must not all read
`503 draining`. Event streams are read to their end (the scripted text is short). /metrics is
not in the schema (`include_in_schema=False`) and takes no input.
"""

from __future__ import annotations

from typing import Any

import pytest
import requests
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings

from dgpp.engine.server.app import attach_state, create_app
from dgpp.engine.server.core.config import ServerConfig
from dgpp.engine.server.pipeline.state import ServerState
from dgpp.engine.server.routes.admin_routes import DRAIN_KEY
from tests.engine.server.fuzz_checks import TEXT, FuzzEngine, assert_error_shape, fuzz_examples

EXAMPLES = fuzz_examples(25)  # per operation
TIMEOUT_S = 10.0  # far beyond any scripted answer: a request this slow is a hang
ADMIN_KEY = "fuzz-admin"
# The app starts without an engine (its schema does not depend on one); `_serving` attaches the
# scripted engine once the session's tokenizer is loaded. No periodic stats log in a test.
CONFIG = ServerConfig(served_model_names=("m", "*"), admin_key=ADMIN_KEY, stats_log_interval_s=0)
APP = create_app(None, CONFIG)
# The schema the app serves at /openapi.json, read without a request (a request at import would
# start the app's lifespan at collection); with `app` set, cases go to the app in process.
schema = schemathesis.openapi.from_dict(APP.openapi())
schema.app = APP


@pytest.fixture(autouse=True, scope="module")
def _serving(tokenizer: Any) -> None:
    attach_state(APP, ServerState(FuzzEngine(tokenizer, TEXT), CONFIG, ("m", "*")))  # type: ignore[arg-type]


@schema.parametrize()
@settings(
    max_examples=EXAMPLES,
    derandomize=True,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
def test_every_route_answers_without_5xx(case: Any) -> None:
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"} if case.path.startswith("/admin") else {}
    try:
        response = case.call(headers=headers, timeout=TIMEOUT_S)
    except requests.exceptions.Timeout:
        pytest.fail(f"{case.method} {case.path} hung past {TIMEOUT_S} s: {case.body!r}")
    finally:
        setattr(APP.state, DRAIN_KEY, None)
    request = f"{case.method} {case.formatted_path} {case.headers!r} {case.body!r}"
    assert response.status_code < 500, f"{request} -> {response.status_code} {response.text}"
    if 400 <= response.status_code < 500:
        try:
            assert_error_shape(case.path, response.status_code, response.json())
        except AssertionError as err:
            raise AssertionError(f"{request} -> {response.status_code}: {err}") from None


@pytest.mark.parametrize("path", ["/tokenize", "/v1/chat/completions", "/v1/messages"])
def test_a_body_that_is_not_utf8_is_refused_as_invalid_json(path: str) -> None:
    """Found by the fuzzer: the body b'\\x80' got FastAPI's bare 400 'There was an error parsing
    the body' with no code."""
    client = TestClient(APP)  # no `with`: the app needs no lifespan (its stats log is off)
    response = client.post(path, content=b"\x80", headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert_error_shape(path, 400, response.json())
    if path.startswith("/v1/messages"):
        assert "not valid JSON" in response.json()["error"]["message"]
    else:
        assert response.json()["error"]["code"] == "invalid_json"
