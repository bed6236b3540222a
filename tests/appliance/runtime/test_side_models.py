"""Side models under a real `dgpp serve` (issue 67): a main model and four side models (generate
with Claude Code's haiku alias, embed, rerank `always`, and one whose checkpoint is missing), each
side model its own `dgpp serve` process behind the main one's front, over real HTTP. It routes by
name and alias (streams too), loads on demand, unloads idle ones and the least recently used one
when `side_memory_gib` is short, survives a side model's crash, fails a bad load with its reason,
and lists every model's state; the main model keeps serving throughout."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from dgpp.appliance.deployments.deployment import parse_deployment
from dgpp.appliance.deployments.side_models import SideModel
from dgpp.appliance.runtime.side_supervisor import SideModels
from dgpp.engine.errors import ConfigError
from dgpp.engine.server.core.errors import APIError
from tests.appliance.world_harness import start, wait_healthy, write_deployment
from tests.conftest import build_tiny_checkpoint, build_tiny_embedder

CHAT = {"max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}


def _cards(url: str) -> dict[str, dict[str, Any]]:
    return {card["id"]: card for card in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]}


def _until(url: str, name: str, state: str, timeout: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        card = _cards(url)[name]
        if card["state"] == state:
            return card
        time.sleep(0.2)
    raise AssertionError(f"{name} not {state}: {_cards(url)[name]}")


def _console_buttons(tmp_path: Path, deployment: Path, url: str) -> None:
    """The console's Models page lists the side models with rank 0's states, and its buttons
    unload and load one (the console in process, rank 0 over real HTTP)."""
    from fastapi.testclient import TestClient

    from dgpp.webui.app import create_app
    from tests.webui.conftest import PASSWORD, USER, console_config, hidden

    folder = tmp_path / "console"
    folder.mkdir()
    shutil.copy(deployment, folder / "deployment.json")
    app = create_app(console_config(folder, engine_url=url))
    with TestClient(app, base_url="http://127.0.0.1") as client:
        token = hidden(client.get("/login").text, "csrf_token")
        form = {"username": USER, "password": PASSWORD, "csrf_token": token, "next": "/"}
        client.post("/login", data=form, follow_redirects=False)
        page = client.get("/models").text
        assert 'id="side-rr" data-state="loaded"' in page
        assert 'id="side-emb" data-state="unloaded"' in page
        token = hidden(page, "csrf_token")
        done = client.post("/models/side/rr/unload", data={"csrf_token": token})
        assert 'id="side-rr" data-state="unloaded"' in done.text
        assert "rr: unloaded" in done.text
        client.post("/models/side/rr/load", data={"csrf_token": token})
    _until(url, "rr", "loaded")


@pytest.mark.slow
def test_side_models_route_load_unload_and_survive_crashes(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    main = build_tiny_checkpoint(tmp_path / "main", tokenizer_dir, "LlamaForCausalLM")
    fast = build_tiny_checkpoint(tmp_path / "fast", tokenizer_dir, "LlamaForCausalLM", seed=4)
    reranker = build_tiny_checkpoint(tmp_path / "rr", tokenizer_dir, "Qwen3ForCausalLM", seed=5)
    embedder = build_tiny_embedder(tmp_path / "emb", tokenizer_dir)
    small = {"kv_capacity": 512, "num_threads": 1}
    sides = [
        {"name": "fast", "model": str(fast), "aliases": ["claude-3-5-haiku*"], "memory_gib": 0.5,
         "engine": small},
        {"name": "emb", "model": str(embedder), "kind": "embed", "memory_gib": 0.5,
         "idle_unload_s": 4, "engine": small},
        {"name": "rr", "model": str(reranker), "kind": "rerank", "load": "always",
         "memory_gib": 0.25, "engine": small},
        {"name": "broken", "model": str(tmp_path / "nowhere"), "memory_gib": 0.1},
    ]  # fmt: skip
    deployment = write_deployment(
        tmp_path / "d.json", main, world_size=1, side_models=sides, side_memory_gib=1.0
    )
    url = f"http://127.0.0.1:{json.loads(deployment.read_text())['http']['port']}"
    process = start(["serve", "--deployment", str(deployment)], tmp_path / "serve.log")
    try:
        wait_healthy(url, process)
        cards = _cards(url)
        assert list(cards) == ["m", "fast", "emb", "rr", "broken"]
        assert cards["m"]["kind"] == "generate" and cards["fast"]["state"] == "unloaded"
        assert cards["emb"]["kind"] == "embed" and cards["rr"]["load"] == "always"
        _until(url, "rr", "loaded")  # `always`: loaded at start
        # Claude Code's small fast model, by its haiku alias: loaded on demand, then answered.
        haiku = {"model": "claude-3-5-haiku-20241022", **CHAT}
        answer = httpx.post(f"{url}/v1/messages", json=haiku, timeout=120)
        assert answer.status_code == 200, answer.text
        assert answer.json()["type"] == "message" and answer.json()["model"] == "fast"
        with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=60,
                          json={"model": "fast", "stream": True, **CHAT}) as stream:  # fmt: skip
            events = [line for line in stream.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) >= 3
        # A client that leaves mid-stream releases its lease (the side server aborts it).
        long = {"model": "fast", "stream": True, **CHAT, "max_tokens": 400, "ignore_eos": True}
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=long, timeout=60) as stream:
            next(stream.iter_lines())
        deadline = time.monotonic() + 10
        while _cards(url)["fast"]["in_flight"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _cards(url)["fast"]["in_flight"] == 0
        # The embedder does not fit beside fast and rr (1 GiB): the idle fast one goes first.
        embedded = httpx.post(f"{url}/v1/embeddings", json={"model": "emb", "input": "x"},
                              timeout=120)  # fmt: skip
        assert embedded.status_code == 200, embedded.text
        assert len(embedded.json()["data"][0]["embedding"]) == 64
        cards = _cards(url)
        assert (cards["fast"]["state"], cards["fast"]["unloads"]) == ("unloaded", 1)
        assert "unloaded side model fast: making room for emb" in process.text()
        # Each kind's wrong endpoint, answered by the side model's own server.
        wrong = httpx.post(f"{url}/v1/chat/completions", json={"model": "emb", **CHAT}, timeout=60)
        assert wrong.status_code == 400 and "/v1/embeddings" in wrong.json()["error"]["message"]
        rerank = {"model": "rr", "query": "q", "documents": ["a", "b"]}
        scored = httpx.post(f"{url}/v1/rerank", json=rerank, timeout=60)
        assert scored.status_code == 200 and len(scored.json()["results"]) == 2
        # A crash: the main model does not notice; the next request loads it again.
        os.kill(_cards(url)["emb"]["pid"], signal.SIGKILL)
        card = _until(url, "emb", "unloaded")
        assert card["crashes"] == 1
        assert httpx.post(f"{url}/v1/chat/completions", json={"model": "m", **CHAT},
                          timeout=60).status_code == 200  # fmt: skip
        again = httpx.post(f"{url}/v1/embeddings", json={"model": "emb", "input": "x"},
                           timeout=120)  # fmt: skip
        assert again.json() == embedded.json()
        # Idle past its TTL: unloaded.
        _until(url, "emb", "unloaded", timeout=30)
        assert "unloaded side model emb: idle 4 s" in process.text()
        # A load that fails: that request gets the reason; everything else serves on.
        broken = httpx.post(f"{url}/v1/chat/completions", json={"model": "broken", **CHAT},
                            timeout=120)  # fmt: skip
        assert broken.status_code == 502, broken.text
        error = broken.json()["error"]
        assert error["code"] == "model_load_failed" and "no such checkpoint" in error["message"]
        assert _cards(url)["broken"]["state"] == "failed"
        unknown = httpx.post(f"{url}/v1/chat/completions", json={"model": "x", **CHAT}, timeout=60)
        assert unknown.status_code == 404
        assert "side models 'fast', 'emb', 'rr', 'broken'" in unknown.json()["error"]["message"]
        assert (
            httpx.post(
                f"{url}/v1/rerank",
                timeout=60,
                json={"model": "rr", "query": "q", "documents": ["a"]},
            ).status_code
            == 200
        )
        # Metrics: every side model in /v1/metrics and /metrics.
        sides = {card["id"]: card for card in httpx.get(f"{url}/v1/metrics").json()["side_models"]}
        assert sides["emb"]["loads"] == 2 and sides["emb"]["crashes"] == 1
        text = httpx.get(f"{url}/metrics").text
        assert 'dgpp:side_model_state{model_name="rr",state="loaded"} 1.0' in text
        assert 'dgpp:side_model_crashes_total{model_name="emb"} 1.0' in text
        # A side model's own metrics through the front (the console's history by model): a
        # loaded one's engine counters; an unloaded one a 409, and asking does not load it.
        own = httpx.get(f"{url}/v1/metrics", params={"model": "rr"}).json()
        assert own["scheduler"]["prompt_tokens_total"] > 0 and "side_models" in own
        assert "dgpp:" in httpx.get(f"{url}/metrics", params={"model": "rr"}).text
        idle = httpx.get(f"{url}/v1/metrics", params={"model": "emb"})
        assert idle.status_code == 409 and idle.json()["error"]["code"] == "model_not_loaded"
        assert _cards(url)["emb"]["state"] == "unloaded"
        assert httpx.get(f"{url}/v1/metrics", params={"model": "x"}).status_code == 404
        # The console's buttons: unload and load (admin routes; loopback without an admin key).
        stopped = httpx.post(f"{url}/admin/models/rr/unload", timeout=60).json()
        assert stopped["state"] == "unloaded" and stopped["pid"] is None
        assert httpx.post(f"{url}/admin/models/rr/load", timeout=120).json()["state"] == "loaded"
        missing = httpx.post(f"{url}/admin/models/m/unload", timeout=60)
        assert missing.status_code == 404 and "main model" in missing.json()["error"]["message"]
        _console_buttons(tmp_path, deployment, url)
        rr_pid = _cards(url)["rr"]["pid"]
    finally:
        process.stop()
    with pytest.raises(ProcessLookupError):  # the side models stopped with the server
        os.kill(rr_pid, 0)


def test_a_request_waits_for_a_load_up_to_the_knob_then_gets_503_retry_after(
    tmp_path: Path,
) -> None:
    """A side model whose server takes longer than `side_load_wait_s` to answer its health
    check: the request gets 503 with Retry-After; the load goes on."""
    import asyncio

    side = SideModel(name="slow", model="default", memory_gib=0.1)
    models = SideModels([side], tmp_path / "run", tmp_path / "logs", load_wait_s=0.5)
    models.serve_command = [sys.executable, "-c", "import time; time.sleep(60)"]
    models.start()
    try:

        async def ask() -> None:
            async with models.lease("slow"):
                pass

        began = time.monotonic()
        with pytest.raises(APIError) as refused:
            asyncio.run(ask())
        assert 0.5 <= time.monotonic() - began < 5
        assert refused.value.status == 503 and refused.value.headers.get("Retry-After")
        assert "still loading" in refused.value.message
        assert models.listing()[0]["state"] == "loading"
    finally:
        models.stop(timeout_s=5)
    assert models.listing()[0]["state"] == "unloaded"
    assert (tmp_path / "run").stat().st_mode & 0o777 == 0o700  # the sockets' folder


@pytest.mark.parametrize(
    ("sides", "says"),
    [
        ([{"name": "a", "model": "x"}, {"name": "a", "model": "y"}], "'a' already names"),
        ([{"name": "m", "model": "x"}], "'m' already names the main model"),
        ([{"name": "a", "model": "x", "node": 1}], "node 1 is not a rank"),
        ([{"name": "a", "model": "x", "kind": "embed", "engine": {"kind": "rerank"}}],
         "contradicts its kind"),
        ([{"name": "a b", "model": "x"}], "side_models.0.name"),
        ([{"name": "a", "model": "x", "load": "sometimes"}], "side_models.0.load"),
    ],
)  # fmt: skip
def test_bad_side_models_are_refused_naming_the_key(sides: list, says: str) -> None:
    raw = {"model": "default", "http": {"served_model_names": ["m"]}, "side_models": sides}
    with pytest.raises(ConfigError, match=says):
        parse_deployment(raw)


# A side server stand-in for the supervisor's own logic: real processes answering /health on the
# deployment's socket, slow to stop (3 s after SIGTERM) as a large model freeing its memory is.
SLOW_STOPPER = """
import http.server, json, signal, socketserver, sys, time
uds = json.loads(open(sys.argv[sys.argv.index("--deployment") + 1]).read())["http"]["uds"]
signal.signal(signal.SIGTERM, lambda *_: (time.sleep(3), sys.exit(0)))
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("content-length", "0"); self.end_headers()
    def log_message(self, *args):
        pass
class Server(socketserver.UnixStreamServer):
    def get_request(self):
        request, _ = super().get_request()
        return request, ("side", 0)
Server(uds, Health).serve_forever()
"""


def test_a_load_waits_for_the_memory_of_one_stopping_without_blocking_the_server(
    tmp_path: Path,
) -> None:
    """Making room never waits on the event loop: while the idle side model takes 3 s to stop,
    the listing answers at once and the new one starts only once the memory is free."""
    import asyncio

    sides = [SideModel(name=name, model="default", memory_gib=1.0) for name in ("a", "b")]
    models = SideModels(sides, tmp_path / "run", tmp_path / "logs", memory_bytes=3 << 29)
    models.serve_command = [sys.executable, "-c", SLOW_STOPPER]
    models.start()

    async def scenario() -> tuple[float, float]:
        async with models.lease("a"):
            pass
        began = time.monotonic()
        loading = asyncio.ensure_future(models.load("b"))
        slowest, ticked = 0.0, time.monotonic()
        await asyncio.sleep(0.05)  # the load has asked for room
        while not loading.done():
            # A loop iteration's whole time: the event loop blocked by the load shows here.
            slowest = max(slowest, time.monotonic() - ticked - 0.05)
            ticked = time.monotonic()
            states = {card["id"]: card["state"] for card in models.listing()}
            assert states["a"] == "unloaded" and states["b"] in ("loading", "loaded"), states
            await asyncio.sleep(0.05)
        await loading
        return time.monotonic() - began, slowest

    try:
        waited, slowest = asyncio.run(scenario())
    finally:
        models.stop(timeout_s=10)
    assert waited >= 2.5  # b started after a had exited (1.5 GiB holds one of them)
    assert slowest < 0.5, slowest  # the event loop (the server's) never waited on it
    cards = {card["id"]: card for card in models.listing()}
    assert (cards["a"]["unloads"], cards["b"]["loads"]) == (1, 1)
