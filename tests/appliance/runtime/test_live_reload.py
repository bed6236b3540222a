"""Live knobs: a running rank 0 reloads its deployment (POST /admin/reload, SIGHUP) and takes the
knobs declared live without a restart; any other change is refused with its keys and nothing is
applied. On a real `dgpp serve` world of two over real HTTP, and through a re-formed world."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from dgpp.appliance.commands.rank import expected_config
from dgpp.appliance.deployments.deployment import parse_deployment
from dgpp.appliance.runtime.live_reload import RestartRequiredError, live_changes, live_keys
from dgpp.engine.configuration.engine_config import EngineConfig
from dgpp.engine.configuration.knobs import knobs_of
from dgpp.engine.distributed.world_spec import WorldTimeouts
from dgpp.engine.server.core.config import ServerConfig
from dgpp.webui.deployments.store import engine_target
from dgpp.webui.monitor.engine_client import EngineClient
from tests.appliance.world_harness import start, wait_healthy, write_deployment
from tests.conftest import build_tiny_checkpoint

# What is live, declared on the knobs themselves: the step policy (rank 0's scheduler) and the
# HTTP server's per-request settings. Nothing that sizes memory or that the other ranks read.
LIVE = {
    "engine.short_prompt_tokens",
    "engine.long_prefill_share",
    "engine.step_target_ms",
    "engine.arrival_hold_ms",
    # rank 0's scheduler and prefix cache: how fast a waiting rank ages, how long a session lives
    "engine.priority_aging_s",
    "engine.session_ttl_s",
    "http.served_model_names",
    "http.default_max_tokens",
    "http.max_tokens_policy",
    "http.queue_limit",
    "http.default_chat_template_kwargs",
    "http.default_reasoning_effort",
    # images: read from the server's settings per request
    "http.image_min_pixels",
    "http.image_max_pixels",
    "http.max_images_per_request",
    "http.image_url_fetch",
    "http.image_fetch_timeout_s",
    "http.image_coordinates",
}


def test_the_live_knobs_are_the_declared_ones() -> None:
    declared = {
        each.deployment
        for cls in (EngineConfig, ServerConfig, WorldTimeouts)
        for each in knobs_of(cls)
        if each.live
    }
    assert live_keys() == declared == LIVE


def test_a_change_beyond_live_knobs_is_refused_with_every_such_key() -> None:
    running = parse_deployment({"model": "m", "engine": {"kv_capacity": 2048}})
    tuned = parse_deployment(
        {"model": "m", "engine": {"kv_capacity": 2048, "step_target_ms": 30}},
    )
    assert [change.path for change in live_changes(running, tuned)] == ["engine.step_target_ms"]
    resized = parse_deployment(
        {"model": "n", "engine": {"kv_capacity": 4096, "step_target_ms": 30}},
    )
    with pytest.raises(RestartRequiredError) as refused:
        live_changes(running, resized)
    assert refused.value.message.startswith(
        "these changes need a restart of rank 0 (the console's switch): "
        'engine.kv_capacity (2048 -> 4096), model ("m" -> "n"); live knobs are '
    )


def test_a_worker_does_not_insist_on_rank_0s_live_knobs() -> None:
    """A worker's own file pins the engine knobs it sets, but not the live ones: rank 0 may have
    reloaded those, and the worker's file is not rewritten."""
    own = parse_deployment(
        {"model": "m", "engine": {"kv_capacity": 2048, "step_target_ms": 30.0}},
    )
    assert expected_config(own) == {"world_size": 1, "engine": {"model": "m", "kv_capacity": 2048}}


def _names(url: str) -> list[str]:
    return [entry["id"] for entry in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]]


def _ask(url: str, model: str) -> httpx.Response:
    body = {"model": model, "prompt": "Hello", "max_tokens": 3, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def _edit(path: Path, section: str, **values: object) -> None:
    raw = json.loads(path.read_text())
    raw.setdefault(section, {}).update(values)
    path.write_text(json.dumps(raw))


@pytest.mark.slow
def test_a_running_world_takes_live_knobs_refuses_the_rest_and_keeps_them_when_it_reforms(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    checkpoint = build_tiny_checkpoint(tmp_path / "tiny", tokenizer_dir, "LlamaForCausalLM")
    deployment = write_deployment(tmp_path / "d.json", checkpoint)
    url = f"http://127.0.0.1:{json.loads(deployment.read_text())['http']['port']}"
    process = start(["serve", "--deployment", str(deployment)], tmp_path / "serve.log")
    try:
        wait_healthy(url, process)
        assert _names(url) == ["m"]
        # Live knobs only: applied at once, answered with every change.
        _edit(deployment, "http", served_model_names=["m", "m2"], queue_limit=7)
        _edit(deployment, "engine", step_target_ms=25.0)
        answer = httpx.post(f"{url}/admin/reload", timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.json() == {
            "applied": {
                "engine.step_target_ms": [0.0, 25.0],
                "http.queue_limit": [256, 7],
                "http.served_model_names": [["m"], ["m", "m2"]],
            }
        }
        assert _names(url) == ["m", "m2"]
        assert _ask(url, "m2").status_code == 200
        # Unchanged since: nothing to apply.
        assert httpx.post(f"{url}/admin/reload", timeout=60).json() == {"applied": {}}
        # A knob that sizes memory with a live one: refused whole, nothing applied.
        _edit(deployment, "engine", kv_capacity=4096)
        _edit(deployment, "http", served_model_names=["other"])
        refused = httpx.post(f"{url}/admin/reload", timeout=60)
        assert refused.status_code == 409, refused.text
        error = refused.json()["error"]
        assert error["code"] == "restart_required"
        assert "engine.kv_capacity (2048 -> 4096)" in error["message"]
        assert "http.served_model_names" not in error["message"].split("; live knobs")[0]
        assert _names(url) == ["m", "m2"]
        # The console's client reads both answers of the real server.
        client = EngineClient(engine_target(parse_deployment(json.loads(deployment.read_text()))))
        ok, detail = asyncio.run(client.reload())
        assert not ok and "engine.kv_capacity (2048 -> 4096)" in detail, detail
        _edit(deployment, "engine", kv_capacity=2048)
        _edit(deployment, "http", served_model_names=["m", "m2"], queue_limit=9)
        assert asyncio.run(client.reload()) == (True, "http.queue_limit 7 -> 9")
        # A file that does not validate: 400 with the schema's words, nothing applied.
        _edit(deployment, "engine", kv_capacity=2048, prefill_chunk_tokens=0)
        invalid = httpx.post(f"{url}/admin/reload", timeout=60)
        assert invalid.status_code == 400, invalid.text
        assert "prefill_chunk_tokens" in invalid.json()["error"]["message"]
        # SIGHUP (systemctl reload) reloads too; the outcome goes to the log.
        _edit(deployment, "engine", prefill_chunk_tokens=512)
        _edit(deployment, "http", served_model_names=["m3"])
        os.kill(process.pid, signal.SIGHUP)
        deadline = time.monotonic() + 30
        while _names(url) != ["m3"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _names(url) == ["m3"], process.text()[-3000:]
        assert "reloaded live: http.served_model_names" in process.text()
        # `systemctl reload` of a worker's unit: it logs the signal and serves on.
        (worker,) = process.worker_pids()
        os.kill(worker, signal.SIGHUP)
        deadline = time.monotonic() + 10
        while "nothing to reload on rank 1" not in process.text() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "nothing to reload on rank 1" in process.text()
        assert process.worker_pids() == [worker] and _ask(url, "m3").status_code == 200
        # A re-formed world (its worker killed) keeps the reloaded knobs.
        os.kill(worker, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            health = httpx.get(f"{url}/health", timeout=10)
            if health.status_code == 200 and health.json().get("generation", 0) > 1:
                break
            time.sleep(0.5)
        assert health.json().get("generation", 0) > 1, process.text()[-3000:]
        assert _names(url) == ["m3"]
        assert _ask(url, "m3").status_code == 200
    finally:
        assert process.stop() == 0, process.text()[-3000:]
