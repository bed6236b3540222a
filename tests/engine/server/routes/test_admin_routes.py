"""POST /admin/drain and /admin/undrain through a scripted engine: new generation requests are
refused with `503 draining` while the rest of the API keeps answering; the admin key (not the
API key) guards them, and without one they answer loopback clients only.
GET /admin/nodes answers from the reader rank 0's runtime sets, with each snapshot's age."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from fastapi.testclient import TestClient

from dgpp.engine.scheduling.stats import EngineStats
from dgpp.engine.server.app import create_app
from dgpp.engine.server.core.config import ServerConfig
from dgpp.engine.server.pipeline.state import ServerState
from dgpp.engine.server.routes.admin_routes import set_nodes_reader
from tests.engine.server.harness import assert_error
from tests.engine.server.metrics.test_metrics_fake import STATS
from tests.engine.server.scripted import ScriptedEngine

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


class BusyEngine(ScriptedEngine):
    """The scripted engine reporting `running` and `waiting` requests."""

    def __init__(self, tokenizer: Any, running: int = 0, waiting: int = 0) -> None:
        super().__init__(tokenizer, "Hello!")
        self.snapshot = replace(STATS, running=running, waiting=waiting)

    def stats(self) -> EngineStats:
        return self.snapshot


LOCAL = ("127.0.0.1", 50123)
REMOTE = ("192.0.2.7", 50123)


def _client(engine: Any, client: tuple[str, int] = LOCAL, **config: Any) -> TestClient:
    settings = ServerConfig(served_model_names=("m",), stats_log_interval_s=0, **config)
    return TestClient(create_app(ServerState(engine, settings, ("m",))), client=client)


def test_drain_refuses_new_generation_requests_and_undrain_admits_again(tokenizer: Any) -> None:
    with _client(BusyEngine(tokenizer)) as client:
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
        drained = client.post("/admin/drain")
        assert drained.status_code == 200
        assert drained.json()["draining"] is True
        for path, body in (
            ("/v1/chat/completions", CHAT),
            ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 4}),
        ):
            refused = client.post(path, json=body)
            assert_error(refused, 503, "draining", None, type_="server_error")
            assert refused.headers["retry-after"] == "5"
        anthropic = client.post(
            "/v1/messages",
            json={"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
        )
        assert anthropic.status_code == 503
        assert anthropic.json()["type"] == "error"
        # Everything that is not a generation keeps working.
        assert client.get("/health").status_code == 200
        assert client.get("/v1/models").json()["data"][0]["id"] == "m"
        assert client.post("/tokenize", json={"prompt": "hi"}).status_code == 200
        service = client.get("/v1/metrics").json()["service"]
        assert (service["succeeded"], service["shed"], service["failed"]) == (1, 3, 0)
        undrained = client.post("/admin/undrain")
        assert undrained.json()["draining"] is False
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_drain_reports_the_requests_left_and_keeps_its_start(tokenizer: Any) -> None:
    with _client(BusyEngine(tokenizer, running=2, waiting=3)) as client:
        assert client.get("/admin/drain").json()["draining"] is False
        first = client.post("/admin/drain").json()
        assert (first["running"], first["waiting"], first["state"]) == (2, 3, "serving")
        second = client.post("/admin/drain").json()
        assert second["since"] == first["since"]
        assert client.get("/admin/drain").json()["draining"] is True


def test_drain_while_starting_reports_no_requests() -> None:
    app = create_app(None, ServerConfig(served_model_names=("m",), stats_log_interval_s=0))
    with TestClient(app, client=LOCAL) as client:
        body = client.post("/admin/drain").json()
        assert (body["draining"], body["state"], body["running"], body["waiting"]) == (
            True,
            "starting",
            0,
            0,
        )


def test_without_an_admin_key_the_admin_routes_answer_loopback_clients_only(
    tokenizer: Any,
) -> None:
    with _client(BusyEngine(tokenizer), client=REMOTE, api_key="sekrit") as client:
        auth = {"Authorization": "Bearer sekrit"}
        for method, path in (("post", "/admin/drain"), ("post", "/admin/undrain")):
            refused = getattr(client, method)(path, headers=auth)  # the API key is not enough
            assert_error(refused, 403, "admin_forbidden", None, type_="permission_error")
        assert client.get("/admin/nodes", headers=auth).status_code == 403
        assert client.post("/v1/chat/completions", json=CHAT, headers=auth).status_code == 200
    with _client(BusyEngine(tokenizer), client=LOCAL, api_key="sekrit") as client:
        assert client.post("/admin/drain").json()["draining"] is True


def test_admin_routes_take_the_admin_key_and_only_it(tokenizer: Any) -> None:
    keys = {"api_key": "sekrit", "admin_key": "admin-sekrit"}
    with _client(BusyEngine(tokenizer), client=REMOTE, **keys) as client:
        for method, path in (("post", "/admin/drain"), ("post", "/admin/undrain")):
            refused = getattr(client, method)(path, headers={"Authorization": "Bearer sekrit"})
            assert_error(refused, 401, "invalid_api_key", None, type_="authentication_error")
        assert client.get("/admin/drain").status_code == 401
        admin = {"x-api-key": "admin-sekrit"}
        assert client.post("/admin/drain", headers=admin).json()["draining"] is True
        # The admin key is not an API key; without one a client learns nothing of the drain.
        assert client.post("/v1/chat/completions", json=CHAT, headers=admin).status_code == 401
        refused = client.post("/v1/chat/completions", json=CHAT, headers={"x-api-key": "sekrit"})
        assert_error(refused, 503, "draining", None, type_="server_error")


def test_metrics_stay_open_unless_the_knob_puts_them_behind_the_key(tokenizer: Any) -> None:
    with _client(BusyEngine(tokenizer), client=REMOTE, api_key="sekrit") as client:
        assert client.get("/metrics").status_code == 200
        assert client.get("/v1/metrics").status_code == 401
    closed = {"api_key": "sekrit", "metrics_require_key": True}
    with _client(BusyEngine(tokenizer), client=REMOTE, **closed) as client:
        refused = client.get("/metrics")
        assert_error(refused, 401, "invalid_api_key", None, type_="authentication_error")
        assert client.get("/metrics", headers={"Authorization": "Bearer sekrit"}).status_code == 200
        assert client.get("/health").status_code == 200


def test_nodes_lists_every_rank_with_its_age_behind_the_admin_key(tokenizer: Any) -> None:
    now = time.time()
    snapshots = [
        {"rank": 0, "hostname": "spark-1", "time": now - 3, "gpu": {"available": False}},
        {"rank": 1, "hostname": "spark-2", "time": now + 60, "cpu": {"count": 20}},  # skewed
        {"rank": 2, "hostname": None, "time": None, "error": "no reading from this rank yet"},
    ]
    with _client(BusyEngine(tokenizer), client=REMOTE, admin_key="sekrit") as client:
        refused = client.get("/admin/nodes")
        assert_error(refused, 401, "invalid_api_key", None, type_="authentication_error")
        auth = {"Authorization": "Bearer sekrit"}
        assert client.get("/admin/nodes", headers=auth).json() == {"nodes": []}  # no reader
        set_nodes_reader(client.app, lambda: snapshots)  # type: ignore[arg-type]
        nodes = client.get("/admin/nodes", headers=auth).json()["nodes"]
    assert [node["rank"] for node in nodes] == [0, 1, 2]
    assert 3 <= nodes[0]["age_s"] < 30 and nodes[0]["gpu"] == {"available": False}
    assert nodes[1]["age_s"] == 0.0  # a clock ahead of rank 0's never gives a negative age
    assert nodes[2]["age_s"] is None and nodes[2]["error"] == "no reading from this rank yet"
