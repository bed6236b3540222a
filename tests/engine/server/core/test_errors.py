"""Error bodies over real sockets: status, `error.type`, `error.code` and `error.param` exactly,
and after each error the server still serves and holds no KV block."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.engine.server.conftest import MAX_MODEL_LEN, MODEL
from tests.engine.server.harness import (
    RunningServer,
    assert_error,
    assert_still_serving,
    error_of,
    server_settings,
)

CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]
LONG_TEXT = "hello " * (MAX_MODEL_LEN + 50)  # one token per word: over the context alone


@pytest.fixture(autouse=True)
def _still_serving_afterwards(server: RunningServer) -> Iterator[None]:
    yield
    assert_still_serving(server)


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": HI, "max_tokens": 2, **fields}


def test_malformed_json(http: httpx.Client) -> None:
    for path in (CHAT, "/v1/completions", "/tokenize"):
        response = http.post(
            path,
            content=b'{"model": "smollm", "messages": [',
            headers={"content-type": "application/json"},
        )
        assert_error(response, 400, "invalid_json", None)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": "ten"}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"stream": "yes"}, "stream"),
        ({"n": True}, "n"),
        ({"messages": "hi"}, "messages"),
        ({"model": 3}, "model"),
        ({"logprobs": 1}, "logprobs"),
        ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
        ({"messages": [{"role": "user"}, 5]}, "messages.1"),
        ({"logit_bias": {"5": "x"}}, "logit_bias.5"),
    ],
)
def test_wrong_types_name_the_param(http: httpx.Client, fields: dict, param: str) -> None:
    assert_error(http.post(CHAT, json=_chat(**fields)), 400, "invalid_type", param)


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        (CHAT, {"stop": 7}, "stop"),
        (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        (CHAT, {"tool_choice": 5}, "tool_choice"),
        ("/v1/completions", {"prompt": 5, "messages": None}, "prompt"),
    ],
)
def test_wrong_type_of_a_union_field_names_the_field(
    http: httpx.Client, path: str, fields: dict, param: str
) -> None:
    body = {k: v for k, v in _chat(**fields).items() if v is not None}
    assert_error(http.post(path, json=body), 400, "invalid_type", param)


@pytest.mark.parametrize(
    ("content", "content_type"),
    [
        (b"", "application/json"),
        (b"[1, 2]", "application/json"),
        (b'{"model": "smollm", "messages": []}', "application/x-www-form-urlencoded"),
    ],
    ids=["empty", "array", "form-content-type"],
)
def test_body_that_is_not_an_object_has_a_sensible_message(
    http: httpx.Client, content: bytes, content_type: str
) -> None:
    response = http.post(CHAT, content=content, headers={"content-type": content_type})
    error = assert_error(response, 400, error_of(response)["code"], None)
    assert "None" not in error["message"], error["message"]


def test_wrong_type_in_completions(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "x", "echo": "no"}
    assert_error(http.post("/v1/completions", json=body), 400, "invalid_type", "echo")


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (CHAT, _chat(bogus=1)),
        (CHAT, _chat(stream_options={"include_usage": True, "extra": 1}, stream=True)),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2, "messages": HI}),
        ("/tokenize", {"prompt": "x", "temperature": 0}),
        ("/detokenize", {"tokens": [1], "prompt": "x"}),
    ],
)
def test_unknown_parameter_is_ignored(http: httpx.Client, path: str, body: dict) -> None:
    """As vLLM: a field dgpp does not know is dropped (and logged once), never a 400, so a
    client's next release keeps working."""
    response = http.post(path, json=body)
    assert response.status_code == 200, response.text


def test_missing_required_parameter(http: httpx.Client) -> None:
    assert_error(http.post(CHAT, json={"messages": HI}), 400, "missing_required_parameter", "model")
    assert_error(
        http.post(CHAT, json={"model": MODEL}), 400, "missing_required_parameter", "messages"
    )


def test_unknown_role(http: httpx.Client) -> None:
    body = _chat(messages=[{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}])
    response = http.post(CHAT, json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "messages.1.role")


def test_empty_messages(http: httpx.Client) -> None:
    response = http.post(CHAT, json=_chat(messages=[]))
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "messages")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "b"}]}, "messages.0.role"),
        ({"temperature": 5.0}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
def test_value_constraint_errors_are_coded_invalid_value(
    http: httpx.Client, fields: dict, param: str
) -> None:
    assert_error(http.post(CHAT, json=_chat(**fields)), 400, "invalid_value", param)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"top_logprobs": 2}, "top_logprobs"),  # top_logprobs without logprobs
        ({"response_format": {"type": "xml"}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
        ),
        ({"logit_bias": {"abc": 1.0}}, "logit_bias"),
        ({"logit_bias": {"5": 500.0}}, "logit_bias"),
        ({"logit_bias": {"49152": 1.0}}, "logit_bias"),  # past the vocabulary (49,152 ids)
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]},
            "tools",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"$schema": "http://x.example"}},
                    }
                ]
            },
            "tools",
        ),
        ({"stop": [""]}, "stop"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ],
)
def test_invalid_values_name_the_param(http: httpx.Client, fields: dict, param: str) -> None:
    assert_error(http.post(CHAT, json=_chat(**fields)), 400, "invalid_value", param)


def test_a_streamed_request_with_logit_bias_past_the_vocabulary_is_refused_before_it_starts(
    http: httpx.Client,
) -> None:
    body = _chat(logit_bias={"100000": -5.0}, stream=True)
    assert_error(http.post(CHAT, json=body), 400, "invalid_value", "logit_bias")


def test_both_output_limits_take_max_completion_tokens(http: httpx.Client) -> None:
    """guidellm sends both (its documented request extras); vLLM takes max_completion_tokens."""
    for max_tokens, max_completion_tokens in ((2, 5), (5, 2)):
        body = _chat(
            max_tokens=max_tokens, max_completion_tokens=max_completion_tokens, ignore_eos=True
        )
        response = http.post(CHAT, json=body)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == max_completion_tokens


def test_a_body_nested_too_deeply_says_so(http: httpx.Client) -> None:
    """A 5,000-deep body was refused as 'not UTF-8 text'."""
    for body in (b"[" * 5000 + b"]" * 5000, b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"):
        response = http.post(CHAT, content=body, headers={"content-type": "application/json"})
        assert_error(response, 400, "invalid_json", None)
        assert "nests JSON arrays and objects too deeply" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": []}, "prompt"),
        ({"prompt": [[]]}, "prompt"),
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({"prompt": "x", "best_of": 3}, "best_of"),
        ({"prompt": [49152]}, "prompt"),  # token id outside the vocabulary
        ({"prompt": "x", "logit_bias": {"49152": 2.0}}, "logit_bias"),
    ],
)
def test_invalid_completion_requests(http: httpx.Client, body: dict, param: str) -> None:
    response = http.post("/v1/completions", json={"model": MODEL, "max_tokens": 2, **body})
    assert_error(response, 400, "invalid_value", param)


def test_invalid_token_id_prompt_in_a_stream_is_a_400(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": [49152], "max_tokens": 2, "stream": True}
    assert_error(http.post("/v1/completions", json=body), 400, "invalid_value", "prompt")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": MAX_MODEL_LEN}, "max_tokens"),
        ({"max_tokens": None, "max_completion_tokens": MAX_MODEL_LEN}, "max_completion_tokens"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_prompt_plus_max_tokens_over_context_when_rejecting(
    http: httpx.Client, server: RunningServer, fields: dict, param: str, stream: bool
) -> None:
    body = {k: v for k, v in _chat(stream=stream, **fields).items() if v is not None}
    with server_settings(server, max_tokens_policy="reject"):
        response = http.post(CHAT, json=body)
    error = assert_error(response, 400, "context_length_exceeded", param)
    assert str(MAX_MODEL_LEN) in error["message"]


def test_completion_prompt_plus_max_tokens_over_context_when_rejecting(
    http: httpx.Client, server: RunningServer
) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": MAX_MODEL_LEN}
    with server_settings(server, max_tokens_policy="reject"):
        response = http.post("/v1/completions", json=body)
    assert_error(response, 400, "context_length_exceeded", "max_tokens")


def test_chat_prompt_alone_over_context(http: httpx.Client) -> None:
    messages = [{"role": "user", "content": LONG_TEXT}]
    body = {"model": MODEL, "messages": messages}
    error = assert_error(http.post(CHAT, json=body), 400, "context_length_exceeded", "messages")
    assert str(MAX_MODEL_LEN) in error["message"]


def test_chat_prompt_alone_over_context_with_max_tokens(http: httpx.Client) -> None:
    body = _chat(messages=[{"role": "user", "content": LONG_TEXT}], max_tokens=5)
    assert_error(http.post(CHAT, json=body), 400, "context_length_exceeded", "messages")


@pytest.mark.parametrize("prompt", [LONG_TEXT, [9906] * (MAX_MODEL_LEN + 1)], ids=["text", "ids"])
def test_completion_prompt_alone_over_context(http: httpx.Client, prompt: Any) -> None:
    for max_tokens in (None, 5):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}
        response = http.post("/v1/completions", json=body)
        assert_error(response, 400, "context_length_exceeded", "prompt")


def test_unknown_path_is_404(http: httpx.Client) -> None:
    assert_error(http.post("/v1/nothing", json={}), 404, "not_found", None)
    assert_error(http.get("/v2/models"), 404, "not_found", None)


def test_wrong_method_is_405(http: httpx.Client) -> None:
    response = http.get(CHAT)
    assert_error(response, 405, "method_not_allowed", None)
    assert "POST" in response.headers["allow"]
    assert_error(http.post("/v1/models", json={}), 405, "method_not_allowed", None)


def test_unknown_model_is_404(http: httpx.Client) -> None:
    response = http.post(CHAT, json=_chat(model="nope"))
    assert_error(response, 404, "model_not_found", "model")
    response = http.post("/tokenize", json={"model": "nope", "prompt": "x"})
    assert_error(response, 404, "model_not_found", "model")
    assert_error(http.get("/v1/models/nope"), 404, "model_not_found", "model")


def test_body_under_the_default_limit_is_served(http: httpx.Client) -> None:
    padded = [{"role": "user", "content": "hi", "name": "x" * 100_000}]
    response = http.post(CHAT, json=_chat(messages=padded))
    assert response.status_code == 200, response.text
