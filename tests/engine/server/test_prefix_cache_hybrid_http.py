"""A hybrid model (Qwen3-Next: recurrent layers) behind the HTTP API: the routes hint the end of
the system prompt, the engine snapshots the recurrent state there, and the next request with the
same system prompt restores it (OpenAI Chat Completions and Anthropic Messages)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from dgpp.engine.server.chat.render import render
from tests.conftest import build_tiny_checkpoint
from tests.engine.server.harness import RunningServer, running_server

SYSTEM = "You are a careful assistant. Always answer in one short sentence. " * 12


@pytest.fixture(scope="module")
def hybrid_server(
    tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path
) -> Iterator[RunningServer]:
    checkpoint = build_tiny_checkpoint(
        tmp_path_factory.mktemp("qwen3-next-http"), tokenizer_dir, "Qwen3NextForCausalLM"
    )
    options = {"kv_capacity": 4096, "block_size": 16, "prefix_min_tokens": 0}
    with running_server(checkpoint, ("m",), options) as server:
        yield server


def _system_tokens(server: RunningServer) -> int:
    """Where the routes hint: the system message rendered on its own."""
    tokenizer = server.state.tokenizer
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "x"}]
    prompt = render(tokenizer, messages, None, {}, True, hint_system=True)
    assert prompt.cache_hints and prompt.cache_hints[0] > 100
    return prompt.cache_hints[0]


def _chat(client: httpx.Client, question: str) -> dict[str, Any]:
    body = {
        "model": "m",
        "max_tokens": 4,
        "temperature": 0,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
    }
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["usage"]


def test_the_system_prompt_snapshot_serves_the_next_request(hybrid_server: RunningServer) -> None:
    system = _system_tokens(hybrid_server)
    with httpx.Client(base_url=hybrid_server.url, timeout=60) as client:
        assert _chat(client, "Name a colour.")["prompt_tokens_details"]["cached_tokens"] == 0
        # without the hint there would be no snapshot at the system prompt's end yet
        cached = _chat(client, "Name a fruit.")["prompt_tokens_details"]["cached_tokens"]
        assert cached == system // 16 * 16
        body = {
            "model": "m",
            "max_tokens": 4,
            "system": SYSTEM,
            "messages": [{"role": "user", "content": "Name a tree."}],
        }
        response = client.post("/v1/messages", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["cache_read_input_tokens"] == system // 16 * 16
        metrics = client.get("/v1/metrics").json()["prefix_cache"]["state_snapshots"]
    assert metrics["hits"] == 2
    assert metrics["hits_by_depth_tokens"] == {str(system // 16 * 16): 2}
