"""The console end to end in headless Chromium (Playwright, the system's /usr/bin/chromium): a real
engine under the local backend, a login, the overview's charts drawing from it, invalid knobs
refused without a restart, valid ones applied (n-gram speculative decoding among them, whose
acceptance chart then draws), and a switch to a second model.

Screenshots land in the test's tmp dir, and in $DGPP_TEST_ARTIFACTS when that is set."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from dgpp.webui.app import create_app
from dgpp.webui.config import parse_console_config
from dgpp.webui.security.credentials import write_credentials
from tests.conftest import build_tiny_checkpoint
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

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not CHROMIUM.exists(), reason="no /usr/bin/chromium (apt-get install -y chromium)"
    ),
]


def _wait(what: str, predicate: Callable[[], Any], timeout: float, every: float = 0.5) -> Any:
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


@pytest.fixture
def appliance(tmp_path: Path, default_checkpoint: Path) -> Iterator[Appliance]:
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
        artifacts = os.environ.get("DGPP_TEST_ARTIFACTS")
        if artifacts:
            target = Path(artifacts) / "webui-e2e"
            shutil.copytree(shots, target, dirs_exist_ok=True)
    assert not thread.is_alive(), "the console did not stop"


@pytest.fixture
def browser() -> Iterator[Any]:
    playwright_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    with playwright_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
        )
        try:
            yield launched
        finally:
            launched.close()


def _chat(appliance: Appliance, model: str, text: str, max_tokens: int = 8) -> None:
    response = httpx.post(
        f"{appliance.engine_url}/v1/chat/completions",
        json={
            "model": model,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens,
            "temperature": 0,
        },
        timeout=120,
    )
    assert response.status_code == 200, response.text


def _spec_decode(appliance: Appliance) -> dict[str, Any]:
    metrics = httpx.get(f"{appliance.engine_url}/v1/metrics", timeout=5).json()
    return metrics["spec_decode"]


# Code to copy: the model's answer repeats the prompt, which n-gram lookup drafts from.
SNIPPET = """def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


for i in range(10):
    print(i, fibonacci(i))
"""


def _wait_for_switch(page: Any, shots: Path, name: str) -> str:
    page.wait_for_url("**/switch")
    # Selector waits: the console's Content Security Policy forbids the eval behind
    # wait_for_function, and the test keeps that policy on.
    page.locator("#job[data-final='true']").wait_for(timeout=READY_S * 2 * 1000)
    page.screenshot(path=str(shots / name), full_page=True)
    return page.inner_text("#job-phase")


def test_console_end_to_end(
    appliance: Appliance, browser: Any, tmp_path: Path, tokenizer_dir: Path
) -> None:
    tiny = build_tiny_checkpoint(tmp_path / "tiny-llama", tokenizer_dir, "LlamaForCausalLM")
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(60_000)
    shots = appliance.shots

    # Log in: every page sends an anonymous visitor to the form first.
    page.goto(f"{appliance.console_url}/models")
    page.wait_for_url("**/login?next=*")
    page.fill("input[name=username]", USER)
    page.fill("input[name=password]", PASSWORD)
    page.click("#login-submit")
    page.wait_for_url("**/models")
    page.screenshot(path=str(shots / "01-models.png"), full_page=True)

    # The overview's charts draw from the live engine started by the local backend.
    _wait("the default model serving", appliance.health, READY_S)
    for text in ("Name three rivers.", "Name three rivers.", "Count to five."):
        _chat(appliance, "default", text)
    page.goto(appliance.console_url)

    def points(chart: str) -> int:
        return int(page.get_attribute(f"#chart-{chart}", "data-points") or 0)

    _wait("the charts drawing", lambda: points("throughput") > 0 and points("kv") > 0, 60)
    assert page.locator("#chart-throughput canvas").count() == 1
    assert page.inner_text("#health-state") == "serving"
    # One row per rank, from rank 0's /admin/nodes: GPUs unavailable here (no NVIDIA driver).
    assert page.locator("#nodes tbody tr").count() >= 1
    assert "unavailable" in page.inner_text("#nodes") or "MHz" in page.inner_text("#nodes")
    page.screenshot(path=str(shots / "02-overview.png"), full_page=True)

    # Invalid knobs: each error is shown on its field, nothing restarts.
    uptime_before = appliance.health()["uptime_s"]
    page.goto(f"{appliance.console_url}/knobs")
    page.fill("input[name='engine.kv_capacity']", "-5")
    page.fill("input[name='speculative.ngram_min']", "6")
    page.click("#preview-knobs")
    error = page.inner_text("[id='error-engine.kv_capacity']")
    assert "greater than or equal to 1" in error
    error = page.inner_text("[id='error-speculative.ngram_min']")
    assert error == "ngram_min (6) must not exceed ngram_max (4)"
    page.screenshot(path=str(shots / "03-knob-invalid.png"), full_page=True)
    assert json.loads(appliance.deployment.read_text())["engine"]["kv_capacity"] == 2048
    assert appliance.health()["uptime_s"] >= uptime_before  # the same server, still up
    assert _spec_decode(appliance)["method"] == "off"

    # Valid knobs: the engine restarts with them, n-gram speculative decoding on.
    page.fill("input[name='engine.kv_capacity']", "1024")
    page.fill("input[name='speculative.ngram_min']", "2")
    page.select_option("select[name='speculative.method']", "ngram")
    page.click("#preview-knobs")
    diff = page.inner_text("#diff")
    assert "engine.kv_capacity" in diff and "speculative.method" in diff
    assert "speculative.ngram_min" not in diff
    page.click("#apply")
    assert _wait_for_switch(page, shots, "04-knob-applied.png") == "ready"
    written = json.loads(appliance.deployment.read_text())
    assert written["engine"]["kv_capacity"] == 1024
    assert written["speculative"] == {"method": "ngram"}
    metrics = httpx.get(f"{appliance.engine_url}/v1/metrics", timeout=5).json()
    assert metrics["scheduler"]["kv_blocks_total"] == 1024 // 16
    assert (metrics["spec_decode"]["method"], metrics["spec_decode"]["depth"]) == ("ngram", 4)

    # Text that repeats its prompt gets drafts, and the acceptance chart a point.
    page.goto(appliance.console_url)
    _wait("the overview naming the method", lambda: "ngram" in page.inner_text("#spec-state"), 30)
    assert page.inner_text("#spec-state") == "ngram, depth 4"
    _chat(appliance, "default", f"Repeat this code exactly, nothing else:\n\n{SNIPPET}", 64)
    spec = _spec_decode(appliance)
    assert spec["drafted"] > 0 and 0 <= spec["accepted"] <= spec["drafted"], spec
    _wait("the acceptance chart drawing", lambda: points("spec") > 0, 60)
    assert page.locator("#chart-spec canvas").count() == 1
    # That request was short: the prompt-class chart has its TTFT and queue time.
    _wait("the prompt-class chart drawing", lambda: points("classes") > 0, 60)
    page.screenshot(path=str(shots / "05-overview-speculative.png"), full_page=True)

    # Switch to a second model: preview the diff, apply, follow it until /health is 200.
    page.goto(f"{appliance.console_url}/models")
    page.fill("#model", str(tiny))
    page.fill("#served_name", "tiny")
    page.click("#preview-model")
    assert "http.served_model_names" in page.inner_text("#diff")
    page.screenshot(path=str(shots / "06-switch-preview.png"), full_page=True)
    page.click("#apply")
    assert _wait_for_switch(page, shots, "07-switch-done.png") == "ready"
    assert appliance.served() == ["tiny"]
    assert _spec_decode(appliance)["method"] == "ngram"  # the knobs stay with a new model
    _chat(appliance, "tiny", "Hello")
