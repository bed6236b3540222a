"""Request priority over real HTTP (`server.core.priority`), on the default model: the body's
`priority` on Chat Completions, Completions and Responses, the `x-dgpp-priority` header on
Anthropic's /v1/messages, a key's default and its limit (clamped and logged, not refused), every
one seen by the engine (its per-priority counts in /v1/metrics and /metrics); bad values get a
400 naming the field, an unknown key a 401."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from dgpp.engine.server.core.priority import KeyPolicy
from tests.engine.server.conftest import DEFAULT_ENGINE, MODEL
from tests.engine.server.harness import RunningServer, error_of, running_server

MAIN, CI = "main-key", "ci-key"
KEYS = (KeyPolicy("ci", CI, priority=10, priority_limit=5),)
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
TEXT = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
RESPONSE = {"model": MODEL, "input": "Hi", "max_output_tokens": 2}


@pytest.fixture(scope="module")
def server(default_checkpoint: Path) -> Iterator[RunningServer]:
    options = {"api_key": MAIN, "api_keys": KEYS}
    with running_server(default_checkpoint, (MODEL,), DEFAULT_ENGINE, options) as running:
        yield running


def _client(server: RunningServer, key: str) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.Client(base_url=server.url, timeout=60.0, headers=headers)


def _requests_by_priority(server: RunningServer) -> dict[str, int]:
    with _client(server, MAIN) as http:
        body = http.get("/v1/metrics").json()["priorities"]
    return {label: entry["requests"] for label, entry in body.items()}


def test_each_api_and_key_sets_the_priority_the_engine_runs(
    server: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    before = _requests_by_priority(server)
    sent: list[tuple[str, str, dict[str, Any], dict[str, str]]] = [
        (MAIN, "/v1/chat/completions", {**CHAT, "priority": 3}, {}),
        (MAIN, "/v1/completions", TEXT, {"x-dgpp-priority": "4"}),
        (MAIN, "/v1/responses", {**RESPONSE, "priority": 2}, {}),
        (MAIN, "/v1/messages", {**CHAT, "max_tokens": 2}, {"x-dgpp-priority": "-1"}),
        (CI, "/v1/chat/completions", CHAT, {}),  # the key's default
        (CI, "/v1/messages", CHAT, {"x-dgpp-priority": "0"}),  # above its limit: clamped to 5
        (MAIN, "/v1/chat/completions", CHAT, {}),  # 0
    ]  # fmt: skip
    with caplog.at_level(logging.INFO, logger="dgpp.engine.server.core.priority"):
        for key, path, body, headers in sent:
            with _client(server, key) as http:
                response = http.post(path, json=body, headers=headers)
                assert response.status_code == 200, (path, response.text)
    got = _requests_by_priority(server)
    delta = {label: got[label] - before.get(label, 0) for label in got}
    assert {label: n for label, n in delta.items() if n} == {
        "3": 1, "4": 1, "2": 1, "-1": 1, "10": 1, "5": 1, "0": 1,
    }  # fmt: skip
    assert "key ci asked for priority 0, above its limit: runs at 5" in caplog.text
    assert CI not in caplog.text  # the key's name, never the key
    with _client(server, MAIN) as http:
        text = http.get("/metrics").text
    assert (
        'dgpp:time_to_first_token_by_priority_seconds_count{model_name="smollm",priority="10"}'
        in text
    )
    assert "dgpp:num_requests_by_priority" in text or "priority=" in text
    with _client(server, "not-a-key") as http:
        assert http.post("/v1/chat/completions", json=CHAT).status_code == 401


@pytest.mark.parametrize(
    ("path", "body", "headers", "param"),
    [
        ("/v1/chat/completions", {**CHAT, "priority": "high"}, {}, "priority"),
        ("/v1/chat/completions", {**CHAT, "priority": 1.5}, {}, "priority"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "priority": 5000}, {}, "priority"),
        ("/v1/responses", {"model": MODEL, "input": "x", "priority": True}, {}, "priority"),
        ("/v1/chat/completions", CHAT, {"x-dgpp-priority": "soon"}, "x-dgpp-priority"),
        ("/v1/chat/completions", CHAT, {"x-dgpp-priority": "-1001"}, "x-dgpp-priority"),
    ],
)
def test_a_bad_priority_is_a_400_naming_the_field(
    server: RunningServer, path: str, body: dict[str, Any], headers: dict[str, str], param: str
) -> None:
    with _client(server, MAIN) as http:
        response = http.post(path, json=body, headers=headers)
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert (error["type"], error["param"]) == ("invalid_request_error", param), error
    assert param in error["message"]
    server.wait_idle()


def test_anthropic_gets_its_own_error_shape_for_a_bad_header(server: RunningServer) -> None:
    with _client(server, MAIN) as http:
        response = http.post("/v1/messages", json=CHAT, headers={"x-dgpp-priority": "1.5"})
    assert response.status_code == 400
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "x-dgpp-priority" in body["error"]["message"]


def _sessions(server: RunningServer, key: str) -> dict[str, dict[str, Any]]:
    with _client(server, key) as http:
        response = http.get("/v1/sessions")
    assert response.status_code == 200, response.text
    return {row["id"]: row for row in response.json()["data"]}


def test_each_client_names_its_session_and_only_its_key_sees_and_releases_it(
    server: RunningServer,
) -> None:
    """Codex's `prompt_cache_key`, Claude Code's `metadata.user_id` and an `x-session-id`
    header each name a session, scoped to the key: the CI key neither lists nor releases the
    main key's, and an id too long to keep stands as a digest."""
    long_id = "x" * 300
    sent: list[tuple[str, str, dict[str, Any], dict[str, str]]] = [
        (MAIN, "/v1/responses", {**RESPONSE, "prompt_cache_key": "codex-conv"}, {}),
        (MAIN, "/v1/chat/completions", {**CHAT, "prompt_cache_key": "codex-conv"}, {}),
        (MAIN, "/v1/messages", {**CHAT, "metadata": {"user_id": "user_1_session_abc"}}, {}),
        (MAIN, "/v1/completions", TEXT, {"x-session-id": long_id}),
        (CI, "/v1/chat/completions", CHAT, {"x-session-id": "ci-job"}),
    ]
    for key, path, body, headers in sent:
        with _client(server, key) as http:
            assert http.post(path, json=body, headers=headers).status_code == 200
    mine = _sessions(server, MAIN)
    assert {"codex-conv", "user_1_session_abc"} <= set(mine)
    assert mine["codex-conv"]["requests"] == 2
    assert "ci-job" not in mine and long_id not in mine
    assert any(name.startswith("sha256:") for name in mine)
    row = mine["codex-conv"]
    assert set(row) == {
        "id", "idle_s", "expired", "tokens", "requests", "prompt_tokens", "hit_tokens", "hit_rate",
    }  # fmt: skip
    assert set(row["tokens"]) == {"device"} and row["expired"] is False
    assert set(_sessions(server, CI)) == {"ci-job"}
    with _client(server, CI) as http:  # another key's session: as unknown
        assert http.delete("/v1/sessions/codex-conv").status_code == 404
    with _client(server, MAIN) as http:
        response = http.delete("/v1/sessions/codex-conv")
        assert response.json() == {"id": "codex-conv", "object": "session", "deleted": True}
        assert http.delete(f"/v1/sessions/{long_id}").status_code == 200
        assert http.delete("/v1/sessions/never-seen").status_code == 404
    assert "codex-conv" not in _sessions(server, MAIN)
    admin = httpx.get(f"{server.url}/admin/sessions", timeout=10).json()["data"]  # loopback
    assert {"ci/ci-job", "default/user_1_session_abc"} <= {row["id"] for row in admin}
    response = httpx.delete(f"{server.url}/admin/sessions/ci/ci-job", timeout=10)
    assert response.status_code == 200
    assert _sessions(server, CI) == {}
