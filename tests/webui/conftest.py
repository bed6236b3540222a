"""A console on a fake world: the control backend and the engine replaced, the rest real."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from dgpp.webui.app import create_app
from dgpp.webui.core.config import ConsoleConfig, parse_console_config
from dgpp.webui.routes.deps import get_backend, get_engine_factory
from dgpp.webui.routes.overview_routes import get_nodes_factory
from dgpp.webui.security.credentials import write_credentials
from tests.webui.fakes import FakeBackend, FakeEngine, FakeWorld

USER, PASSWORD = "admin", "correct horse battery"
DEPLOYMENT = {
    "model": "/models/small",
    "engine": {"kv_capacity": 2048, "max_model_len": 512},
    "http": {"served_model_names": ["m"]},
}


def hidden(html: str, name: str) -> str:
    """The value of the hidden input `name` in a page."""
    match = re.search(rf'name="{re.escape(name)}" value="([^"]*)"', html)
    assert match is not None, f"no hidden {name} in the page"
    return match.group(1)


@dataclass
class Console:
    client: TestClient
    world: FakeWorld
    config: ConsoleConfig
    app: FastAPI

    def login(self, username: str = USER, password: str = PASSWORD) -> Any:
        page = self.client.get("/login")
        token = hidden(page.text, "csrf_token")
        return self.client.post(
            "/login",
            data={"username": username, "password": password, "csrf_token": token, "next": "/"},
            follow_redirects=False,
        )

    def csrf(self) -> str:
        page = self.client.get("/knobs")
        assert page.status_code == 200, page.text
        return hidden(page.text, "csrf_token")

    def preview_knobs(self, fields: dict[str, str]) -> Any:
        """POST the Knobs form with `fields` (key path -> text) and this session's token."""
        return self.client.post("/knobs/preview", data={"csrf_token": self.csrf(), **fields})

    def written(self) -> dict[str, Any]:
        """The deployment file as it is now."""
        return json.loads(self.config.deployment.read_text())

    def apply(self, deployment: dict[str, Any], title: str = "test") -> None:
        """POST /switch with `deployment`, as the preview page's Apply button does."""
        response = self.client.post(
            "/switch",
            data={"deployment": json.dumps(deployment), "title": title, "csrf_token": self.csrf()},
            follow_redirects=False,
        )
        assert response.status_code == 303, response.text
        assert response.headers["location"] == "/switch"

    def wait_for_switch(self, timeout: float = 10.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            body = self.client.get("/api/switch").json()
            if body["job"] is not None and body["job"]["final"]:
                return body["job"]
            time.sleep(0.05)
        raise AssertionError(f"the switch did not finish: {body}")


def console_config(tmp_path: Path, **overrides: Any) -> ConsoleConfig:
    deployment = tmp_path / "deployment.json"
    if not deployment.exists():
        deployment.write_text(json.dumps(DEPLOYMENT))
    credentials = tmp_path / "webui.credentials"
    if not credentials.exists():
        write_credentials(credentials, USER, PASSWORD)
    settings = {
        "backend": "local",
        "deployment": str(deployment),
        "state_dir": str(tmp_path / "state"),
        "credentials": str(credentials),
        "autostart": False,
        "sample_interval_s": 0,
        "warm_plans": False,  # every template's plan at each start: the tests that want it say so
        "drain_timeout_s": 0.5,
        "ready_timeout_s": 2.0,
        "poll_interval_s": 0.05,
        **overrides,
    }
    return parse_console_config(settings)


@pytest.fixture
def console(tmp_path: Path) -> Iterator[Console]:
    with running_console(tmp_path) as running:
        yield running


@contextmanager
def running_console(tmp_path: Path, **settings: Any) -> Iterator[Console]:
    """A console (its settings overridden by `settings`) on a fresh fake world."""
    config = console_config(tmp_path, **settings)
    world = FakeWorld(config.deployment)
    world.restart()
    backend = FakeBackend(world)
    app = create_app(config, backend=backend)
    app.dependency_overrides[get_backend] = lambda: backend
    app.dependency_overrides[get_engine_factory] = lambda: lambda d: FakeEngine(world, d)
    app.dependency_overrides[get_nodes_factory] = lambda: lambda d: FakeEngine(world, d)
    with TestClient(app, base_url="http://127.0.0.1") as client:
        yield Console(client, world, config, app)


@pytest.fixture
def logged_in(console: Console) -> Console:
    response = console.login()
    assert response.status_code == 303, response.text
    return console
