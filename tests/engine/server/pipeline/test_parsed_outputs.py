"""Tool calls and reasoning through the HTTP layer, with a scripted engine (a real model cannot be
made to emit them on demand): OpenAI chat (whole and streamed, via the official SDK) and
Anthropic messages."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest
from fastapi.testclient import TestClient

from dgpp.engine.server.app import create_app
from dgpp.engine.server.core.config import ServerConfig
from dgpp.engine.server.pipeline.state import ServerState
from tests.engine.server.scripted import ScriptedEngine

TOOL_TEXT = 'Let me look.<tool_call>\n{"name": "ls", "arguments": {"path": "/tmp"}}\n</tool_call>'
THINK_TEXT = "<think>\nThe user greets me.\n</think>\n\nHello!"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "ls",
            "description": "list a folder",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]
THINKING_TEMPLATE = (
    "{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)


def _client(tokenizer: Any, text: str) -> TestClient:
    state = ServerState(ScriptedEngine(tokenizer, text), ServerConfig(), ("m",))  # type: ignore[arg-type]
    return TestClient(create_app(state))


@pytest.fixture
def tool_client(tokenizer: Any) -> Iterator[TestClient]:
    with _client(tokenizer, TOOL_TEXT) as client:
        yield client


def test_openai_sdk_gets_tool_calls_whole_and_streamed(tool_client: TestClient) -> None:
    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=tool_client)
    messages = [{"role": "user", "content": "What is in /tmp?"}]
    reply = sdk.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look."
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.function.name == "ls"
    assert json.loads(call.function.arguments) == {"path": "/tmp"}

    content, names, arguments, finish = "", [], "", None
    for chunk in sdk.chat.completions.create(
        model="m", messages=messages, tools=TOOLS, stream=True
    ):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tool_call in delta.tool_calls or []:
            assert tool_call.index == 0
            if tool_call.function.name:
                names.append(tool_call.function.name)
            arguments += tool_call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert content == "Let me look." and names == ["ls"] and finish == "tool_calls"
    assert json.loads(arguments) == {"path": "/tmp"}


def test_without_tools_the_markup_is_plain_content(tool_client: TestClient) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    message = tool_client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert message["message"]["content"] == TOOL_TEXT and message["finish_reason"] == "stop"
    hidden = {**body, "tools": TOOLS, "tool_choice": "none"}
    message = tool_client.post("/v1/chat/completions", json=hidden).json()["choices"][0]
    assert message["message"]["content"] == TOOL_TEXT


def test_anthropic_tool_use_whole_and_streamed(tool_client: TestClient) -> None:
    sdk = anthropic.Anthropic(base_url="http://testserver", api_key="x", http_client=tool_client)
    tools = [{"name": "ls", "description": "list", "input_schema": {"type": "object"}}]
    kwargs = {
        "model": "m",
        "max_tokens": 50,
        "tools": tools,
        "messages": [{"role": "user", "content": "What is in /tmp?"}],
    }
    message = sdk.messages.create(**kwargs)
    assert message.stop_reason == "tool_use"
    assert [block.type for block in message.content] == ["text", "tool_use"]
    assert message.content[1].name == "ls" and message.content[1].input == {"path": "/tmp"}
    with sdk.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert final.content[0].text == "Let me look."
    assert final.content[1].input == {"path": "/tmp"} and final.content[1].id.startswith("call_")


def test_reasoning_is_split_from_content(tokenizer: Any) -> None:
    thinking = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    thinking.chat_template = THINKING_TEMPLATE
    with _client(thinking, THINK_TEXT) as client:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        reply = client.post("/v1/chat/completions", json=body).json()
        message = reply["choices"][0]["message"]
        assert message["reasoning_content"].strip() == "The user greets me."
        assert message["content"] == "Hello!"
        assert reply["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0
        with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        assert (
            "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
        )
        assert "".join(d.get("content") or "" for d in deltas) == "Hello!"
        anthropic_reply = client.post(
            "/v1/messages",
            json={"model": "m", "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]},
        ).json()
        assert [b["type"] for b in anthropic_reply["content"]] == ["thinking", "text"]
        assert anthropic_reply["content"][1]["text"] == "Hello!"


HERMES_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\nCall tools as <tool_call>{json}</tool_call>.'"
    " + '<|im_end|>\\n' }}{%- endif %}" + THINKING_TEMPLATE
)


@pytest.fixture
def hermes(tokenizer: Any) -> Any:
    copy = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    copy.chat_template = HERMES_TEMPLATE
    return copy


def test_named_tool_choice_forces_that_call(hermes: Any) -> None:
    # The engine only continues after the forced opening `<tool_call>\n{"name": "ls", "arguments": `
    # and here stops without closing the block; the call must still come back whole.
    with _client(hermes, '{"path": "/var"}}') as client:
        sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client)
        choice = {"type": "function", "function": {"name": "ls"}}
        reply = sdk.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], tools=TOOLS, tool_choice=choice
        )
        (call,) = reply.choices[0].message.tool_calls
        assert call.function.name == "ls" and json.loads(call.function.arguments) == {
            "path": "/var"
        }
        assert reply.choices[0].finish_reason == "tool_calls"
        streamed = ""
        for chunk in sdk.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "hi"}],
            tools=TOOLS,
            tool_choice=choice,
            stream=True,
        ):
            for tool_call in chunk.choices[0].delta.tool_calls or []:
                streamed += tool_call.function.arguments or ""
        assert json.loads(streamed) == {"path": "/var"}
        tools = [{"name": "ls", "input_schema": {"type": "object"}}]
        message = client.post(
            "/v1/messages",
            json={
                "model": "m",
                "max_tokens": 20,
                "tools": tools,
                "tool_choice": {"type": "tool", "name": "ls"},
                "messages": [{"role": "user", "content": "hi"}],
            },
        ).json()
        assert message["stop_reason"] == "tool_use"
        assert message["content"][-1]["input"] == {"path": "/var"}


def test_required_tool_choice_lets_the_model_pick_the_name(hermes: Any) -> None:
    with _client(hermes, 'ls", "arguments": {"path": "/"}}\n</tool_call>') as client:
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "tools": TOOLS,
            "tool_choice": "required",
        }
        message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert message["tool_calls"][0]["function"]["name"] == "ls"
        assert message["content"] is None


@pytest.mark.parametrize(
    ("tool_choice", "needle"),
    [
        ({"type": "function", "function": {"name": "rm"}}, "not among the tools"),
        ("sometimes", "tool_choice must be"),
    ],
)
def test_bad_tool_choice_is_a_400(hermes: Any, tool_choice: Any, needle: str) -> None:
    with _client(hermes, "x") as client:
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "tools": TOOLS,
            "tool_choice": tool_choice,
        }
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 400 and needle in response.json()["error"]["message"]
        assert response.json()["error"]["param"] == "tool_choice"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "ls"}}])
def test_a_forced_call_is_constrained_where_the_template_has_no_tool_calls(
    tokenizer: Any, hermes: Any, choice: Any
) -> None:
    """The default template writes no `<tool_call>` blocks (nor do harmony's and DeepSeek's):
    a forced call is still served, its rest constrained to the tools' schemas though no tool is
    strict. Behind a template that writes them, a non-strict forced call is left free."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
    body["tool_choice"] = choice
    rest = '{"path": "/"}}' if isinstance(choice, dict) else 'ls", "arguments": {"path": "/"}}'
    for template_tokenizer, constrained in ((tokenizer, True), (hermes, False)):
        engine = ScriptedEngine(template_tokenizer, rest)
        state = ServerState(engine, ServerConfig(), ("m",))  # type: ignore[arg-type]
        with TestClient(create_app(state)) as client:
            response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        (choice_out,) = response.json()["choices"]
        (call,) = choice_out["message"]["tool_calls"]
        assert call["function"]["name"] == "ls"
        assert json.loads(call["function"]["arguments"]) == {"path": "/"}
        assert choice_out["finish_reason"] == "tool_calls"
        assert (engine.params[-1].grammar is not None) is constrained


@pytest.mark.parametrize("parameters", [5, "object", [1], True])
def test_a_forced_call_of_a_function_whose_parameters_are_not_a_schema_is_a_400(
    tokenizer: Any, parameters: Any
) -> None:
    """Was a 500 (the grammar spread a non-object) once the call is constrained."""
    tools = [{"type": "function", "function": {"name": "ls", "parameters": parameters}}]
    with _client(tokenizer, "{}}") as client:
        for route, body in (
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
            ("/v1/responses", {"input": "hi"}),
        ):
            request_tools = (
                tools
                if route.endswith("completions")
                else [{"type": "function", **tools[0]["function"]}]
            )
            request = {"model": "m", **body, "tools": request_tools, "tool_choice": "required"}
            response = client.post(route, json=request)
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == "tools" and "parameters" in error["message"]
