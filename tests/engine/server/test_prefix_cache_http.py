"""Prefix-cache hits reach clients: `cached_tokens` (OpenAI) and `cache_read_input_tokens`
(Anthropic), the `prefix_cache: false` opt-out, and the JSON metrics."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.engine.server.harness import RunningServer, running_server

SYSTEM = "You are a careful assistant. Always answer in one short sentence. " * 12


@pytest.fixture(scope="module")
def cached_server(default_checkpoint: Path) -> Iterator[RunningServer]:
    options = {"kv_capacity": 4096, "block_size": 16, "prefix_min_tokens": 0}
    with running_server(default_checkpoint, ("m",), options) as server:
        yield server


def _chat(client: httpx.Client, question: str, **extra: object) -> dict:
    body = {
        "model": "m",
        "max_tokens": 4,
        "temperature": 0,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        **extra,
    }
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["usage"]


def test_second_request_reports_cached_tokens(cached_server: RunningServer) -> None:
    with httpx.Client(base_url=cached_server.url, timeout=60) as client:
        first = _chat(client, "Name a colour.")
        assert first["prompt_tokens_details"]["cached_tokens"] == 0
        second = _chat(client, "Name a fruit.")
        cached = second["prompt_tokens_details"]["cached_tokens"]
        assert cached > 100 and cached % 16 == 0 and cached < second["prompt_tokens"]
        opted_out = _chat(client, "Name a fruit.", prefix_cache=False)
        assert opted_out["prompt_tokens_details"]["cached_tokens"] == 0
        streamed = client.post(
            "/v1/chat/completions",
            json={
                "model": "m",
                "max_tokens": 4,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
                "messages": [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": "Name a tree."},
                ],
            },
        ).text
        assert f'"cached_tokens": {cached}' in streamed
        message = client.post(
            "/v1/messages",
            json={
                "model": "m",
                "max_tokens": 4,
                "system": SYSTEM,
                "messages": [{"role": "user", "content": "Name a bird."}],
            },
        ).json()
        usage = message["usage"]
        assert usage["cache_read_input_tokens"] > 100
        metrics = client.get("/v1/metrics").json()["prefix_cache"]
        assert metrics["hits"] >= 3 and metrics["hit_tokens"] >= 3 * 100
    cached_server.wait_idle()
