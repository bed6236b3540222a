"""The Anthropic Messages API with the official `anthropic` SDK against a live server."""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import httpx
import pytest

from dgpp.engine.server.anthropic.convert import strip_volatile_header
from tests.engine.server.conftest import MODEL
from tests.engine.server.harness import RunningServer

GREEDY = {"temperature": 0}  # this SDK version has no `temperature` argument; send it as a field


@pytest.fixture
def client(server: RunningServer) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0) as sdk:
        yield sdk


def test_message_and_stream_agree(client: anthropic.Anthropic, server: RunningServer) -> None:
    kwargs = {
        "model": MODEL,
        "max_tokens": 24,
        "system": "You are a helpful assistant.",
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "extra_body": GREEDY,
    }
    message = client.messages.create(**kwargs)
    assert message.role == "assistant" and message.type == "message"
    assert message.content[0].type == "text" and "Paris" in message.content[0].text
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.input_tokens > 10 and message.usage.output_tokens > 0
    with client.messages.stream(**kwargs) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == message.content[0].text
    assert final.stop_reason == message.stop_reason
    assert final.usage.output_tokens == message.usage.output_tokens
    server.wait_idle()


def test_stream_event_order(http: httpx.Client) -> None:
    body = {
        "model": MODEL,
        "max_tokens": 5,
        "stream": True,
        "temperature": 0,
        "messages": [{"role": "user", "content": "Count: one, two,"}],
    }
    with http.stream("POST", "/v1/messages", json=body) as response:
        events = [line[7:] for line in response.iter_lines() if line.startswith("event: ")]
    assert events[0] == "message_start"
    assert events[-2:] == ["message_delta", "message_stop"]
    assert events.count("content_block_start") == events.count("content_block_stop") == 1
    assert "content_block_delta" in events


def test_max_tokens_and_stop_sequences(client: anthropic.Anthropic) -> None:
    message = client.messages.create(
        model=MODEL,
        max_tokens=3,
        extra_body=GREEDY,
        messages=[{"role": "user", "content": "Write a long poem about the sea."}],
    )
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 3
    full = (
        client.messages.create(
            model=MODEL,
            max_tokens=30,
            extra_body=GREEDY,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
        )
        .content[0]
        .text
    )
    stop = full.split()[2]
    stopped = client.messages.create(
        model=MODEL,
        max_tokens=30,
        stop_sequences=[stop],
        extra_body=GREEDY,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    )
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert stop not in stopped.content[0].text


def test_history_with_tools_thinking_and_results_is_accepted(client: anthropic.Anthropic) -> None:
    message = client.messages.create(
        model=MODEL,
        max_tokens=8,
        extra_body=GREEDY,
        tools=[
            {
                "name": "ls",
                "description": "list files",
                "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
            }
        ],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "List /tmp"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "I should call ls.", "signature": "abc"},
                    {"type": "redacted_thinking", "data": "opaque"},
                    {"type": "tool_use", "id": "toolu_1", "name": "ls", "input": {"path": "/tmp"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.txt b.txt"},
                    {"type": "text", "text": "Which files are there?"},
                ],
            },
        ],
    )
    assert message.content and message.usage.input_tokens > 20


def test_count_tokens_ignores_the_volatile_billing_line(client: anthropic.Anthropic) -> None:
    base = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}
    plain = client.messages.count_tokens(**base, system="You are terse.").input_tokens
    billed = client.messages.count_tokens(
        **base,
        system=[
            {
                "type": "text",
                "text": "x-anthropic-billing-header: cc_version=2.1.3; cch=9f2c1;\nYou are terse.",
            }
        ],
    ).input_tokens
    assert billed == plain


def test_strip_volatile_header_removes_only_that_line() -> None:
    text = "x-anthropic-billing-header: cc_version=1; cch=ab;\nYou are Claude Code.\nMore."
    assert strip_volatile_header(text) == "You are Claude Code.\nMore."
    untouched = "You are Claude Code.\nx-anthropic-billing-header: not first"
    assert strip_volatile_header(untouched) == untouched


@pytest.mark.parametrize(
    ("body", "status", "kind"),
    [
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
            400,
            "invalid_request_error",
        ),  # max_tokens is required
        (
            {"model": "nope", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]},
            404,
            "not_found_error",
        ),
        (
            {"model": MODEL, "max_tokens": 5, "messages": [{"role": "wizard", "content": "x"}]},
            400,
            "invalid_request_error",
        ),
        (
            {
                "model": MODEL,
                "max_tokens": 5,
                "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
            },
            400,
            "invalid_request_error",
        ),
        (
            {  # a tool whose input_schema is no JSON schema
                "model": MODEL,
                "max_tokens": 5,
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"name": "f", "input_schema": {"type": "objekt"}}],
            },
            400,
            "invalid_request_error",
        ),
        (
            {  # the prompt alone is over the context (a max_tokens over it is clamped)
                "model": MODEL,
                "max_tokens": 100000,
                "messages": [{"role": "user", "content": "word " * 2000}],
            },
            400,
            "invalid_request_error",
        ),
    ],
)
def test_errors_have_the_anthropic_shape(
    http: httpx.Client, server: RunningServer, body: dict, status: int, kind: str
) -> None:
    response = http.post("/v1/messages", json=body)
    assert response.status_code == status
    payload = response.json()
    assert payload["type"] == "error" and payload["error"]["type"] == kind
    assert payload["error"]["message"]
    bad_json = http.post(
        "/v1/messages", content=b"{nope", headers={"content-type": "application/json"}
    )
    assert bad_json.status_code == 400 and bad_json.json()["type"] == "error"
    server.wait_idle()
    assert json.loads(http.get("/health").text)["state"] == "serving"
