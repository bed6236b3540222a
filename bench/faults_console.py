"""The console drill: a deployment switch under load, driven through the web console as an
operator does it. `dgpp webui` runs with the local backend (it starts `dgpp serve` from its
deployment file); the drill logs in, and while clients stream posts the new deployment to
`POST /switch` (the preview page's Apply button: drain, write the file, restart rank 0, follow
`/health`), then follows `GET /api/switch` until the job is final.

The switch shrinks the KV pool (2,048 -> 1,024 tokens), so the end state shows the new
deployment serving. `serve_again_s` runs from the POST to the first successful completion after
the job ended: drain, restart and warm start together.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from faults_clients import under_load
from faults_report import DrillResult, DrillSettings, shared_checks
from faults_server import MODEL, end_state, serve_again, wait_ok
from load import _die_with_parent, free_port
from load_clients import Outcome

from dgpp.webui.security.credentials import write_credentials

USER, PASSWORD = "drill", "fault drill password"
KV_BEFORE, KV_AFTER = 2048, 1024
AFTER_S = 2.0
_HIDDEN_CSRF = re.compile(r'name="csrf_token" value="([^"]+)"')


def _deployment(model: str, engine_port: int, kv_capacity: int) -> dict[str, Any]:
    return {
        "model": model,
        "engine": {"kv_capacity": kv_capacity, "max_model_len": 1024, "max_concurrency": 4},
        "http": {
            "host": "127.0.0.1",
            "port": engine_port,
            "served_model_names": [MODEL],
            "stats_log_interval_s": 0,
        },
        "rendezvous": {"port": free_port()},
    }


def _console_files(folder: Path, model: str, engine_port: int, ready_s: float) -> tuple[Path, int]:
    """The console's settings file (and the deployment and login it names); its port."""
    port = free_port()
    deployment = folder / "deployment.json"
    deployment.write_text(json.dumps(_deployment(model, engine_port, KV_BEFORE)))
    credentials = folder / "webui.credentials"
    write_credentials(credentials, USER, PASSWORD)
    settings = {
        "backend": "local",
        "deployment": str(deployment),
        "state_dir": str(folder / "state"),
        "credentials": str(credentials),
        "host": "127.0.0.1",
        "port": port,
        "sample_interval_s": 0,
        "drain_timeout_s": 30,
        "ready_timeout_s": ready_s,
        "poll_interval_s": 0.25,
    }
    path = folder / "webui.json"
    path.write_text(json.dumps(settings))
    return path, port


async def _log_in(browser: httpx.AsyncClient) -> str:
    """Log in through the form; the session's CSRF token (from the Knobs page)."""
    page = await browser.get("/login")
    token = _HIDDEN_CSRF.search(page.text)
    assert token is not None, "no token in the login form"
    form = {"username": USER, "password": PASSWORD, "csrf_token": token.group(1), "next": "/"}
    answer = await browser.post("/login", data=form, follow_redirects=False)
    assert answer.status_code == 303, f"login answered {answer.status_code}"
    knobs = await browser.get("/knobs")
    token = _HIDDEN_CSRF.search(knobs.text)
    assert token is not None, f"no CSRF token on /knobs ({knobs.status_code})"
    return token.group(1)


async def _follow(browser: httpx.AsyncClient, timeout_s: float) -> dict[str, Any]:
    """GET /api/switch until the job is final (as the switch page polls it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = (await browser.get("/api/switch")).json()["job"]
        if job is not None and job["final"]:
            return job
        await asyncio.sleep(0.25)
    raise TimeoutError(f"the switch was not final after {timeout_s:.0f} s")


def _steps(job: dict[str, Any]) -> list[str]:
    return [
        f"+{s['at'] - job['started_at']:.1f} s {s['phase']}: {s['message']}" for s in job["steps"]
    ]


async def console_switch(
    logs: Path, settings: DrillSettings, start_timeout_s: float
) -> DrillResult:
    result = DrillResult(
        "console_switch",
        f"switch from the web console under load (KV pool {KV_BEFORE} -> {KV_AFTER} tokens)",
    )
    folder = logs / "console"
    folder.mkdir(parents=True, exist_ok=True)
    engine_port = free_port()
    config, console_port = _console_files(folder, settings.model, engine_port, start_timeout_s)
    engine = f"http://127.0.0.1:{engine_port}"
    log = folder / "webui.log"
    dgpp = str(Path(sys.executable).with_name("dgpp"))
    with log.open("ab") as sink:
        console = subprocess.Popen(
            [dgpp, "webui", "--config", str(config), "--log-level", "warning"],
            stdout=sink,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,
        )

    def tail() -> str:
        return log.read_text(errors="replace")[-3000:]

    try:
        await wait_ok(f"http://127.0.0.1:{console_port}/login", console, start_timeout_s, tail)
        await wait_ok(f"{engine}/health", console, start_timeout_s, tail)
        new = json.dumps(_deployment(settings.model, engine_port, KV_AFTER) | _kept(config))
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{console_port}", timeout=30
        ) as browser:
            csrf = await _log_in(browser)
            async with under_load(engine, settings, result.records):
                posted = time.monotonic()
                form = {"deployment": new, "title": "fault drill", "csrf_token": csrf}
                answer = await browser.post("/switch", data=form, follow_redirects=False)
                job = await _follow(browser, start_timeout_s + 60)
                result.serve_again_s = await serve_again(
                    engine, posted, settings.serve_again_within_s
                )
                await asyncio.sleep(AFTER_S)
        result.end = await end_state(engine)
    finally:
        console.terminate()  # the console stops the engine it started
        try:
            console.wait(90)
        except subprocess.TimeoutExpired:
            console.kill()
            console.wait()
    cut = [r for r in result.records if r.outcome is Outcome.LOST and r.ttft_s is not None]
    result.figures = {
        "post_switch": answer.status_code,
        "job": f"{job['phase']} after {job['duration_s']:.1f} s",
        "steps": _steps(job),
        "refused_draining": sum(1 for r in result.records if r.detail == "draining"),
        "broken_connections": sum(1 for r in result.records if r.detail.startswith("transport:")),
    }
    result.checks = shared_checks(
        result, transport_errors=True, serve_again_within_s=settings.serve_again_within_s
    )
    result.checks["switch_ready"] = job["phase"] == "ready"
    result.checks["no_stream_cut"] = not cut
    result.checks["new_deployment_serves"] = (
        result.end.get("kv_blocks_total", 0) * result.end.get("kv_block_size", 0) == KV_AFTER
    )
    return result


def _kept(config: Path) -> dict[str, Any]:
    """The keys of the deployment file that the switch keeps as they are (the rendezvous port)."""
    written = json.loads(Path(json.loads(config.read_text())["deployment"]).read_text())
    return {"rendezvous": written["rendezvous"]}
