"""What the console's Chromium end-to-end tests share: a real console with the local backend
starting a real `dgpp serve`, headless Chromium (the system's /usr/bin/chromium through
Playwright), and a few waits and requests.

Screenshots land in the test's tmp dir and are copied to `$DGPP_TEST_ARTIFACTS/webui-e2e/`
(default `build/test-artifacts/webui-e2e/` in the checkout, which git ignores)."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from dgpp.webui.app import create_app
from dgpp.webui.core.config import parse_console_config
from dgpp.webui.security.credentials import write_credentials
from tests.engine.server.harness import free_port

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
USER, PASSWORD = "admin", "end-to-end password"
READY_S = 240.0  # a cold `dgpp serve` on two busy cores: interpreter, torch, weights
VIEWPORT = {"width": 1400, "height": 900}  # every page's screenshot is taken at this size
DEFAULT_ARTIFACTS = Path(__file__).resolve().parents[2] / "build" / "test-artifacts"


def wait_for(what: str, predicate: Callable[[], Any], timeout: float, every: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


@dataclass
class Appliance:
    console_url: str
    engine_url: str
    deployment: Path
    shots: Path

    def health(self) -> dict[str, Any]:
        try:
            response = httpx.get(f"{self.engine_url}/health", timeout=2)
        except httpx.HTTPError:
            return {}
        return response.json() if response.status_code == 200 else {}

    def served(self) -> list[str]:
        body = httpx.get(f"{self.engine_url}/v1/models", timeout=5).json()
        return [card["id"] for card in body["data"]]

    def metrics(self) -> dict[str, Any]:
        return httpx.get(f"{self.engine_url}/v1/metrics", timeout=5).json()

    def chat(self, model: str, text: str, max_tokens: int = 8, **fields: Any) -> None:
        """One chat request; `fields` go into its body too (`priority`, `prompt_cache_key`)."""
        response = httpx.post(
            f"{self.engine_url}/v1/chat/completions",
            json={
                "model": model,
                "messages": [{"role": "user", "content": text}],
                "max_tokens": max_tokens,
                "temperature": 0,
                **fields,
            },
            timeout=120,
        )
        assert response.status_code == 200, response.text

    def shot(self, page: Any, name: str, full_page: bool = False) -> None:
        """A screenshot of what the 1400x900 viewport shows (`full_page`: the whole page)."""
        page.screenshot(path=str(self.shots / name), full_page=full_page)


@contextmanager
def running_appliance(tmp_path: Path) -> Iterator[Appliance]:
    """The default model served by `dgpp serve`, started by the console's local backend."""
    engine_port, console_port = free_port(), free_port()
    deployment = tmp_path / "deployment.json"
    deployment.write_text(
        json.dumps(
            {
                "model": "default",
                "engine": {"kv_capacity": 2048, "max_model_len": 512, "max_concurrency": 4},
                "http": {"port": engine_port, "stats_log_interval_s": 0},
                "rendezvous": {"port": free_port()},
            }
        )
    )
    credentials = tmp_path / "webui.credentials"
    write_credentials(credentials, USER, PASSWORD)
    config = parse_console_config(
        {
            "backend": "local",
            "deployment": str(deployment),
            "state_dir": str(tmp_path / "state"),
            "credentials": str(credentials),
            "port": console_port,
            "sample_interval_s": 1.0,
            "drain_timeout_s": 10.0,
            "ready_timeout_s": READY_S,
        }
    )
    server = uvicorn.Server(
        uvicorn.Config(create_app(config), host="127.0.0.1", port=console_port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, name="console", daemon=True)
    thread.start()
    shots = tmp_path / "screenshots"
    shots.mkdir()
    running = Appliance(
        f"http://127.0.0.1:{console_port}", f"http://127.0.0.1:{engine_port}", deployment, shots
    )
    try:
        yield running
    finally:
        server.should_exit = True  # the console's shutdown stops the engine it started
        thread.join(timeout=90)
        target = Path(os.environ.get("DGPP_TEST_ARTIFACTS") or DEFAULT_ARTIFACTS) / "webui-e2e"
        shutil.rmtree(target, ignore_errors=True)  # only this run's screenshots
        shutil.copytree(shots, target)
    assert not thread.is_alive(), "the console did not stop"


@contextmanager
def chromium() -> Iterator[Any]:
    playwright_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    with playwright_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
        )
        try:
            yield launched
        finally:
            launched.close()


def log_in(page: Any, appliance: Appliance, path: str) -> None:
    """Open `path`: an anonymous visitor is sent to the login form first, then back."""
    page.goto(f"{appliance.console_url}{path}")
    page.wait_for_url("**/login?next=*")
    appliance.shot(page, "00-login.png")
    page.fill("input[name=username]", USER)
    page.fill("input[name=password]", PASSWORD)
    page.click("#login-submit")
    page.wait_for_url(f"**{path}")


def wait_for_switch(page: Any, appliance: Appliance, name: str) -> str:
    """Follow the switch page until the job is final; its phase."""
    page.wait_for_url("**/switch")
    # Selector waits: the console's Content Security Policy forbids the eval behind
    # wait_for_function, and the test keeps that policy on.
    page.locator("#job[data-final='true']").wait_for(timeout=READY_S * 2 * 1000)
    appliance.shot(page, name, full_page=True)
    return page.inner_text("#job-phase")
