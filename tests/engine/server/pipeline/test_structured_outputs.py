"""Structured outputs over real sockets on the default model (SmolLM2-135M, real weights):
JSON schemas and JSON objects in Chat Completions and the Responses API, sampled at
temperature 1 over 80 seeds, strict forced tool calls in Chat, Responses and Anthropic on
the same weights behind a chat template that writes `<tool_call>` blocks, and forced calls of
loose tools behind the model's own template, which writes none."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.engine.server.conftest import DEFAULT_ENGINE, MODEL
from tests.engine.server.harness import (
    RunningServer,
    assert_error,
    linked_checkpoint,
    running_server,
)

CHAT = "/v1/chat/completions"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]
LS = {
    "type": "function",
    "function": {
        "name": "ls",
        "description": "list a folder",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string", "maxLength": 30}},
            "required": ["path"],
            "additionalProperties": False,
        },
    },
}
CAT = {
    "type": "function",
    "function": {
        "name": "cat",
        "description": "print a file",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {
                "file": {"type": "string", "maxLength": 30},
                "lines": {"type": "integer"},
            },
            "required": ["file"],
            "additionalProperties": False,
        },
    },
}
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou can call these tools: {{ tools | tojson }}\n"
    'Call one as <tool_call>\n{"name": NAME, "arguments": ARGS}\n</tool_call><|im_end|>\n'
    "{% endif %}{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_json_schema_holds_for_every_seed(http: httpx.Client) -> None:
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON, "strict": True},
    }
    outputs = []
    for batch in range(5):  # 5 x 16 = 80 sampled answers
        body = {
            "model": MODEL,
            "messages": ASK,
            "response_format": response_format,
            "temperature": 1.0,
            "n": 16,
            "seed": 1000 * batch,
            "max_tokens": 200,
        }
        response = http.post(CHAT, json=body, timeout=300)
        assert response.status_code == 200, response.text
        outputs += [choice["message"]["content"] for choice in response.json()["choices"]]
    for text in outputs:
        jsonschema.validate(json.loads(text), PERSON)
    assert len({text for text in outputs}) > 50  # sampled, not one answer repeated


def test_json_object_mode_gives_objects(sdk: openai.OpenAI) -> None:
    """Any JSON object: nothing bounds a string, so an answer may run out of tokens inside
    one (finish reason `length`); every answer that stopped is an object."""
    reply = sdk.chat.completions.create(
        model=MODEL,
        messages=ASK,
        response_format={"type": "json_object"},
        temperature=1.0,
        n=8,
        seed=3,
        max_tokens=300,
    )
    stopped = [c.message.content or "" for c in reply.choices if c.finish_reason == "stop"]
    assert stopped
    for text in stopped:
        assert isinstance(json.loads(text), dict)


def test_the_responses_api_takes_a_text_format(sdk: openai.OpenAI) -> None:
    response = sdk.responses.create(
        model=MODEL,
        input="Describe a person as JSON.",
        text={
            "format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
        },
        temperature=0,
        max_output_tokens=200,
    )
    jsonschema.validate(json.loads(response.output_text), PERSON)
    assert response.text.format.type == "json_schema"


@pytest.mark.parametrize(
    ("response_format", "param"),
    [
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": 7}},
            "response_format.schema",
        ),
        (
            {
                "type": "json_schema",
                "json_schema": {
                    "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}
                },
            },
            "response_format",
        ),
    ],
)
def test_an_unusable_schema_is_refused(
    http: httpx.Client, response_format: dict, param: str
) -> None:
    body = {"model": MODEL, "messages": ASK, "response_format": response_format, "max_tokens": 5}
    assert_error(http.post(CHAT, json=body), 400, "invalid_value", param)


@pytest.fixture(scope="module")
def tool_server(
    default_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    """The default model's weights (linked, not copied) behind a template with tool calls."""
    folder = linked_checkpoint(default_checkpoint, tmp_path_factory.mktemp("tools"), TOOL_TEMPLATE)
    with running_server(folder, ("tools",), DEFAULT_ENGINE) as server:
        yield server


def _arguments(call: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    return call["function"]["name"], json.loads(call["function"]["arguments"])


@pytest.mark.parametrize("seed", range(4))
def test_a_forced_strict_call_follows_its_schema(tool_server: RunningServer, seed: int) -> None:
    schemas = {"ls": LS["function"]["parameters"], "cat": CAT["function"]["parameters"]}
    with httpx.Client(base_url=tool_server.url, timeout=120) as http:
        for choice in ("required", {"type": "function", "function": {"name": "cat"}}):
            body = {
                "model": "tools",
                "messages": [{"role": "user", "content": "Show me notes.txt"}],
                "tools": [LS, CAT],
                "tool_choice": choice,
                "temperature": 1.0,
                "seed": seed,
                "max_tokens": 120,
            }
            response = http.post(CHAT, json=body)
            assert response.status_code == 200, response.text
            message = response.json()["choices"][0]["message"]
            (call,) = message["tool_calls"]
            name, arguments = _arguments(call)
            if isinstance(choice, dict):
                assert name == "cat"
            jsonschema.validate(arguments, schemas[name])


def test_forced_tools_follow_their_schemas_in_responses_and_anthropic(
    tool_server: RunningServer,
) -> None:
    function = {"type": "function", **LS["function"]}
    with httpx.Client(base_url=tool_server.url, timeout=120) as http:
        response = http.post(
            "/v1/responses",
            json={
                "model": "tools",
                "input": "list /tmp",
                "tools": [function],
                "tool_choice": "required",
                "temperature": 1.0,
                "max_output_tokens": 120,
            },
        )
        assert response.status_code == 200, response.text
        call = response.json()["output"][-1]
        assert call["type"] == "function_call" and call["name"] == "ls"
        jsonschema.validate(json.loads(call["arguments"]), LS["function"]["parameters"])
        anthropic_tool = {
            "name": "ls",
            "description": "list",
            "input_schema": LS["function"]["parameters"],
        }
        message = http.post(
            "/v1/messages",
            json={
                "model": "tools",
                "max_tokens": 120,
                "temperature": 1.0,
                "messages": [{"role": "user", "content": "list /tmp"}],
                "tools": [anthropic_tool],
                "tool_choice": {"type": "tool", "name": "ls"},
            },
        )
        assert message.status_code == 200, message.text
        (block,) = [b for b in message.json()["content"] if b["type"] == "tool_use"]
        jsonschema.validate(block["input"], LS["function"]["parameters"])


def _loose(tool: dict[str, Any]) -> dict[str, Any]:
    """`tool` without `strict`."""
    function = {k: v for k, v in tool["function"].items() if k != "strict"}
    return {"type": "function", "function": function}


def test_a_forced_call_follows_its_schema_under_a_template_without_tool_calls(
    http: httpx.Client,
) -> None:
    """The default model's own template writes no `<tool_call>` blocks (nor do harmony's and
    DeepSeek's): a forced call is constrained to the tools' schemas though no tool is strict,
    in Chat Completions and Anthropic messages alike."""
    schemas = {"ls": LS["function"]["parameters"], "cat": CAT["function"]["parameters"]}
    for choice in ("required", {"type": "function", "function": {"name": "ls"}}):
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Show me notes.txt"}],
            "tools": [_loose(LS), _loose(CAT)],
            "tool_choice": choice,
            "temperature": 1.0,
            "seed": 7,
            "max_tokens": 120,
        }
        response = http.post(CHAT, json=body, timeout=120)
        assert response.status_code == 200, response.text
        (answer,) = response.json()["choices"]
        (call,) = answer["message"]["tool_calls"]
        name, arguments = _arguments(call)
        assert answer["finish_reason"] == "tool_calls"
        assert name == ("ls" if isinstance(choice, dict) else name) and name in schemas
        jsonschema.validate(arguments, schemas[name])
    message = http.post(
        "/v1/messages",
        json={
            "model": MODEL,
            "max_tokens": 120,
            "messages": [{"role": "user", "content": "list /tmp"}],
            "tools": [{"name": "cat", "input_schema": CAT["function"]["parameters"]}],
            "tool_choice": {"type": "any"},
        },
        timeout=120,
    )
    assert message.status_code == 200, message.text
    assert message.json()["stop_reason"] == "tool_use"
    (block,) = [b for b in message.json()["content"] if b["type"] == "tool_use"]
    assert block["name"] == "cat"
    jsonschema.validate(block["input"], CAT["function"]["parameters"])
