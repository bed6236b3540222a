"""What coding agents send, over real sockets on the default model: fields dgpp does not know
are ignored (logged once), Claude Code's request shape is served, served names may be patterns,
and a max_tokens beyond the context is clamped unless the server rejects it."""

from __future__ import annotations

import json
import logging
from typing import Any

import httpx
import pytest

from tests.engine.server.conftest import MAX_MODEL_LEN, MODEL
from tests.engine.server.harness import (
    RunningServer,
    assert_error,
    served_names,
    server_settings,
)

CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "Say hi."}]
NEAR_FULL = "hello " * (MAX_MODEL_LEN - 40)  # leaves a few tokens of the context to generate
ANTHROPIC_HEADERS = {
    "anthropic-version": "2023-06-01",
    "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14",
    "x-api-key": "anything",
}


def claude_code_body(model: str, **fields: Any) -> dict[str, Any]:
    """A `/v1/messages` body shaped as Claude Code 2.1.332 sends it (trimmed: no tools)."""
    return {
        "model": model,
        "max_tokens": 128000,
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "<system-reminder>x"}]},
            # a mid-conversation system turn (Claude Code 2.1.3xx)
            {"role": "system", "content": [{"type": "text", "text": "# Environment\n..."}]},
            {"role": "user", "content": [{"type": "text", "text": "Say hi."}]},
        ],
        "system": [
            {
                "type": "text",
                "text": "x-anthropic-billing-header: cc_version=2.1.328; cc_entrypoint=cli;\n"
                "You are Claude Code.",
                "cache_control": {"type": "ephemeral"},
            }
        ],
        "metadata": {"user_id": "user_abc_account__session_1"},
        "thinking": {"type": "adaptive", "display": "omitted"},
        "output_config": {"effort": "medium"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "temperature": 0,
        **fields,
    }


@pytest.mark.parametrize("stream", [False, True])
def test_claude_code_requests_are_served(
    http: httpx.Client, server: RunningServer, stream: bool
) -> None:
    with served_names(server, (MODEL, "claude-*")):
        response = http.post(
            "/v1/messages?beta=true",
            json=claude_code_body("claude-haiku-4-5-20251001", stream=stream),
            headers=ANTHROPIC_HEADERS,
        )
        count = http.post(
            "/v1/messages/count_tokens?beta=true",
            json={
                k: v for k, v in claude_code_body("claude-opus-4-5").items() if k != "max_tokens"
            },
            headers=ANTHROPIC_HEADERS,
        )
    assert response.status_code == 200, response.text
    if stream:
        assert "event: message_stop" in response.text and "event: error" not in response.text
    else:
        body = response.json()
        assert body["model"] == MODEL and body["stop_reason"] in ("end_turn", "max_tokens")
    assert count.status_code == 200 and count.json()["input_tokens"] > 0
    server.wait_idle()


def test_an_unknown_field_is_logged_once(
    http: httpx.Client, caplog: pytest.LogCaptureFixture
) -> None:
    body = {"model": MODEL, "messages": HI, "max_tokens": 2, "brand_new_field_9f": {"a": 1}}
    with caplog.at_level(logging.WARNING, logger="dgpp.engine.server.openai.tolerant"):
        for _ in range(3):
            assert http.post(CHAT, json=body).status_code == 200
    lines = [r.getMessage() for r in caplog.records if "brand_new_field_9f" in r.getMessage()]
    assert lines == [
        "ignoring the unknown request field 'brand_new_field_9f' of ChatCompletionRequest "
        "(logged once)"
    ]


@pytest.mark.parametrize(
    ("path", "body", "code", "param"),
    [
        (CHAT, {"model": MODEL, "messages": HI, "max_tokens": "2"}, "invalid_type", "max_tokens"),
        (
            CHAT,
            {"model": MODEL, "messages": HI, "reasoning_effort": "extreme"},
            "invalid_value",
            "reasoning_effort",
        ),
        (
            "/v1/messages",
            claude_code_body(MODEL, output_config={"effort": "extreme"}),
            None,
            None,
        ),
        (
            "/v1/messages",
            claude_code_body(MODEL, thinking={"type": "enabled", "budget_tokens": "many"}),
            None,
            None,
        ),
    ],
)
def test_a_known_field_of_the_wrong_type_is_still_refused(
    http: httpx.Client, path: str, body: dict, code: str | None, param: str | None
) -> None:
    response = http.post(path, json=body)
    if path == CHAT:
        assert_error(response, 400, code, param)
    else:  # the Anthropic error shape
        assert response.status_code == 400, response.text
        assert response.json()["error"]["type"] == "invalid_request_error"


def test_served_names_may_be_patterns(http: httpx.Client, server: RunningServer) -> None:
    with served_names(server, (MODEL, "claude-*", "gpt-?o")):
        listed = [card["id"] for card in http.get("/v1/models").json()["data"]]
        ok = http.post(CHAT, json={"model": "claude-opus-4-5", "messages": HI, "max_tokens": 2})
        also = http.post(CHAT, json={"model": "gpt-4o", "messages": HI, "max_tokens": 2})
        missing = http.post(CHAT, json={"model": "llama", "messages": HI, "max_tokens": 2})
    assert listed == [MODEL]  # patterns are not models
    assert ok.status_code == 200 and ok.json()["model"] == MODEL
    assert also.status_code == 200
    assert_error(missing, 404, "model_not_found", "model")
    with served_names(server, (MODEL, "*")):
        anything = http.post(CHAT, json={"model": "whatever/x", "messages": HI, "max_tokens": 2})
    assert anything.status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_beyond_the_context_is_clamped(
    http: httpx.Client, server: RunningServer, stream: bool
) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": NEAR_FULL}],
        "max_tokens": 128000,
        "ignore_eos": True,
        "stream": stream,
        "stream_options": {"include_usage": True} if stream else None,
    }
    response = http.post(CHAT, json={k: v for k, v in body.items() if v is not None})
    assert response.status_code == 200, response.text
    if stream:
        events = [
            json.loads(line[6:])
            for line in response.text.splitlines()
            if line.startswith("data: {")
        ]
        finish = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
        usage = events[-1]["usage"]
    else:
        finish = [response.json()["choices"][0]["finish_reason"]]
        usage = response.json()["usage"]
    assert finish == ["length"]
    assert usage["total_tokens"] == MAX_MODEL_LEN


def test_anthropic_max_tokens_beyond_the_context_is_clamped(http: httpx.Client) -> None:
    body = {
        "model": MODEL,
        "max_tokens": 128000,
        "messages": [{"role": "user", "content": NEAR_FULL}],
    }
    response = http.post("/v1/messages", json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    usage = answer["usage"]
    total = usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["output_tokens"]
    assert total <= MAX_MODEL_LEN
    if total < MAX_MODEL_LEN:  # it ended its turn before the limit
        assert answer["stop_reason"] == "end_turn"
    else:  # clamped at the limit, or its end of turn was the last token that fit
        assert answer["stop_reason"] in ("max_tokens", "end_turn")


def test_rejecting_policy_refuses_what_does_not_fit(
    http: httpx.Client, server: RunningServer
) -> None:
    body = {"model": MODEL, "max_tokens": 128000, "messages": HI}
    with server_settings(server, max_tokens_policy="reject"):
        response = http.post("/v1/messages", json=body)
    assert response.status_code == 400
    assert "exceeds this model's context" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"stop": ["s"] * 65}, "stop"),
        ({"stop": "x" * 1025}, "stop"),
        ({"stop": ["x" * 1025]}, "stop"),
        ({"logit_bias": {str(i): 1.0 for i in range(1025)}}, "logit_bias"),
        ({"stop_token_ids": list(range(65))}, "stop_token_ids"),
    ],
)
def test_stop_strings_and_logit_bias_are_bounded(
    http: httpx.Client, fields: dict, param: str
) -> None:
    body = {"model": MODEL, "messages": HI, "max_tokens": 2, **fields}
    error = assert_error(http.post(CHAT, json=body), 400, "invalid_value", param)
    assert param.split(".")[0] in error["message"]


def test_anthropic_stop_sequences_are_bounded(http: httpx.Client) -> None:
    body = claude_code_body(MODEL, stop_sequences=["s"] * 65)
    response = http.post("/v1/messages", json=body)
    assert response.status_code == 400
    assert "stop_sequences" in response.json()["error"]["message"]
