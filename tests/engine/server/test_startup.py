"""The server answers while the model loads (503 `starting`) and after a failed load."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient

from dgpp.engine.server.app import attach_state, create_app, mark_failed
from dgpp.engine.server.core.config import ServerConfig
from dgpp.engine.server.pipeline.state import ServerState
from tests.engine.server.harness import assert_error
from tests.engine.server.scripted import ScriptedEngine

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_starting_then_serving(tokenizer: Any) -> None:
    config = ServerConfig(served_model_names=("m",))
    app = create_app(None, config)
    with TestClient(app) as client:
        health = client.get("/health")
        assert health.status_code == 503 and health.json() == {"state": "starting"}
        assert health.headers["retry-after"] == "5"
        busy = client.post("/v1/chat/completions", json=CHAT)
        assert_error(busy, 503, "starting", None, type_="server_error")
        assert busy.headers["retry-after"] == "5"
        anthropic = client.post("/v1/messages", json={**CHAT, "max_tokens": 4})
        assert anthropic.status_code == 503 and anthropic.json()["type"] == "error"
        attach_state(app, ServerState(ScriptedEngine(tokenizer, "Hello"), config, ("m",)))  # type: ignore[arg-type]
        assert client.get("/health").json()["state"] == "serving"
        reply = client.post("/v1/chat/completions", json=CHAT).json()
        assert reply["choices"][0]["message"]["content"] == "Hello"


def test_failed_start_is_reported() -> None:
    app = create_app(None, ServerConfig(served_model_names=("m",)))
    mark_failed(app, "ModelLoadError: checkpoint is missing 3 weights")
    with TestClient(app) as client:
        health = client.get("/health")
        assert health.status_code == 503
        assert health.json() == {
            "state": "failed",
            "error": "ModelLoadError: checkpoint is missing 3 weights",
        }
        response = client.post("/v1/chat/completions", json=CHAT)
        assert_error(response, 503, "engine_failure", None, type_="server_error")
