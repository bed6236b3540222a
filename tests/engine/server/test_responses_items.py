"""Responses API items: function calls and reasoning out (through the official SDK, with a
scripted engine: a real model cannot be made to emit them on demand), every input item kind
into the chat layer, and the bounded store of responses."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient

from dgpp.engine.server.app import create_app
from dgpp.engine.server.config import ServerConfig
from dgpp.engine.server.errors import APIError
from dgpp.engine.server.protocol import ChatMessage
from dgpp.engine.server.responses_convert import to_chat_messages, to_chat_tools
from dgpp.engine.server.responses_store import ResponseStore
from dgpp.engine.server.state import ServerState
from tests.engine.server.scripted import ScriptedEngine
from tests.engine.server.test_parsed_outputs import THINK_TEXT, TOOL_TEXT

TOOLS = [
    {
        "type": "function",
        "name": "ls",
        "description": "list a folder",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        "strict": False,
    },
    {"type": "web_search"},  # a hosted tool: left out, logged once
]
THINK_TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}<think>"


@pytest.fixture
def sdk_for(tokenizer: Any) -> Iterator[Any]:
    clients: list[TestClient] = []

    def make(text: str, template: str | None = None) -> openai.OpenAI:
        if template is not None:
            tokenizer.chat_template = template
        state = ServerState(ScriptedEngine(tokenizer, text), ServerConfig(), ("m",))  # type: ignore[arg-type]
        client = TestClient(create_app(state))
        clients.append(client)
        return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client)

    saved = tokenizer.chat_template
    yield make
    tokenizer.chat_template = saved
    for client in clients:
        client.close()


def test_function_calls_whole_and_streamed(sdk_for: Any) -> None:
    sdk = sdk_for(TOOL_TEXT)
    response = sdk.responses.create(model="m", input="What is in /tmp?", tools=TOOLS)
    message, call = response.output
    assert message.type == "message" and message.content[0].text == "Let me look."
    assert call.type == "function_call" and call.name == "ls"
    assert call.call_id.startswith("call_") and json.loads(call.arguments) == {"path": "/tmp"}
    kinds = []
    with sdk.responses.stream(model="m", input="What is in /tmp?", tools=TOOLS) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.function_call_arguments.done":
                assert json.loads(event.arguments) == {"path": "/tmp"} and event.name == "ls"
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds
    assert [item.type for item in final.output] == ["message", "function_call"]
    assert final.output[1].name == "ls"


def test_reasoning_becomes_a_reasoning_item(sdk_for: Any) -> None:
    sdk = sdk_for(THINK_TEXT.removeprefix("<think>\n"), THINK_TEMPLATE)
    response = sdk.responses.create(model="m", input="hi", reasoning={"effort": "low"})
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and "greets" in reasoning.content[0].text
    assert message.content[0].text == "Hello!"
    assert response.usage.output_tokens_details.reasoning_tokens > 0
    kinds = []
    with sdk.responses.stream(model="m", input="hi") as stream:
        kinds = [event.type for event in stream]
    assert kinds.index("response.reasoning_text.delta") < kinds.index("response.output_text.delta")


def test_every_input_item_kind_reaches_the_chat_layer() -> None:
    messages = to_chat_messages(
        [
            {"role": "user", "content": "list /tmp"},
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "use ls"}],
            },
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Looking."}],
            },
            {"type": "function_call", "call_id": "call_1", "name": "ls", "arguments": '{"p": 1}'},
            {"type": "function_call", "call_id": "call_2", "name": "ls", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "a.txt"},
            {
                "type": "function_call_output",
                "call_id": "call_2",
                "output": [{"type": "input_text", "text": "b.txt"}],
            },
        ]
    )
    assert [m.role for m in messages] == ["user", "assistant", "tool", "tool"]
    assistant = messages[1]
    assert (assistant.content, assistant.reasoning_content) == ("Looking.", "use ls")
    assert [c.id for c in assistant.tool_calls or []] == ["call_1", "call_2"]
    assert (messages[2].tool_call_id, messages[2].content) == ("call_1", "a.txt")
    assert messages[3].content == "b.txt"
    assert to_chat_messages("hi") == [ChatMessage(role="user", content="hi")]


def test_function_tools_take_the_chat_shape_and_hosted_tools_are_left_out() -> None:
    tools, namespaces = to_chat_tools(TOOLS)
    (tool,) = tools or []
    assert namespaces == {}
    assert tool == {
        "type": "function",
        "function": {
            "name": "ls",
            "description": "list a folder",
            "parameters": TOOLS[0]["parameters"],
        },
    }
    assert to_chat_tools([{"type": "web_search"}]) == (None, {})
    grouped = {"type": "namespace", "name": "agents", "tools": [{**TOOLS[0], "name": "spawn"}]}
    tools, namespaces = to_chat_tools([grouped])
    assert [t["function"]["name"] for t in tools or []] == ["spawn"]
    assert namespaces == {"spawn": "agents"}


def _body(number: int) -> dict[str, Any]:
    return {"id": f"resp_{number}"}


def test_the_store_is_bounded_by_count_and_age() -> None:
    now = [0.0]
    store = ResponseStore(max_entries=2, ttl_s=10.0, clock=lambda: now[0])
    for number in range(3):
        store.put(_body(number), [])
    assert len(store) == 2
    with pytest.raises(APIError) as missing:
        store.get("resp_0")
    assert (missing.value.status, missing.value.code) == (404, "response_not_found")
    assert store.get("resp_2").body == _body(2)
    now[0] = 10.5
    store.put(_body(3), [])
    assert len(store) == 1  # resp_1 and resp_2 are older than the TTL
    store.delete("resp_3")
    with pytest.raises(APIError):
        store.delete("resp_3")
    empty = ResponseStore(max_entries=0)
    empty.put(_body(9), [])
    assert len(empty) == 0


def test_a_call_of_a_namespaced_function_names_its_namespace(sdk_for: Any) -> None:
    sdk = sdk_for(TOOL_TEXT)
    grouped = {"type": "namespace", "name": "files", "description": "", "tools": [TOOLS[0]]}
    response = sdk.responses.create(model="m", input="What is in /tmp?", tools=[grouped])
    call = response.output[-1]
    assert (call.type, call.name, call.namespace) == ("function_call", "ls", "files")
