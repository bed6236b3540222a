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

from dgpp.engine.errors import InvalidRequestError
from dgpp.engine.server.app import create_app
from dgpp.engine.server.core.config import ServerConfig
from dgpp.engine.server.core.errors import APIError
from dgpp.engine.server.openai.protocol import ChatMessage
from dgpp.engine.server.pipeline.state import ServerState
from dgpp.engine.server.pipeline.tool_choice import openai_choice
from dgpp.engine.server.responses.convert import ToolOrigins, to_chat_messages, to_chat_tools
from dgpp.engine.server.responses.output import function_call_item
from dgpp.engine.server.responses.store import ResponseStore
from tests.engine.server.pipeline.test_parsed_outputs import THINK_TEXT, TOOL_TEXT
from tests.engine.server.scripted import ScriptedEngine

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
    tools, origins = to_chat_tools(TOOLS)
    (tool,) = tools or []
    assert origins == ToolOrigins()
    assert tool == {
        "type": "function",
        "function": {
            "name": "ls",
            "description": "list a folder",
            "parameters": TOOLS[0]["parameters"],
        },
    }
    assert to_chat_tools([{"type": "web_search"}]) == (None, ToolOrigins())
    grouped = {"type": "namespace", "name": "agents", "tools": [{**TOOLS[0], "name": "spawn"}]}
    tools, origins = to_chat_tools([grouped])
    assert [t["function"]["name"] for t in tools or []] == ["spawn"]
    assert origins.namespaces == {"spawn": "agents"}


PATCH_TOOL = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Edit files with a patch.",
    "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch"'},
}


def test_a_custom_tool_is_a_function_of_one_text_argument() -> None:
    tools, origins = to_chat_tools([PATCH_TOOL, *TOOLS])
    assert origins.custom == frozenset({"apply_patch"})
    function = (tools or [])[0]["function"]
    assert function["name"] == "apply_patch"
    assert function["parameters"]["required"] == ["input"]
    assert function["parameters"]["properties"]["input"]["type"] == "string"
    assert function["description"].startswith("Edit files with a patch.")
    assert 'lark grammar:\nstart: "*** Begin Patch"' in function["description"]
    with pytest.raises(InvalidRequestError) as error:
        to_chat_tools([{"type": "custom"}])
    assert error.value.param == "tools.0.name"


def test_a_custom_tool_call_is_reported_with_its_text_input() -> None:
    _, origins = to_chat_tools([PATCH_TOOL])
    text = "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch"
    call = {"id": "call_7", "function": {"name": "apply_patch", "arguments": ""}}
    call["function"]["arguments"] = json.dumps({"input": text})
    item = function_call_item(call, origins)
    assert item == {
        "type": "custom_tool_call",
        "id": "ctc_7",
        "call_id": "call_7",
        "name": "apply_patch",
        "input": text,
        "status": "completed",
    }
    # Arguments that are not {"input": text} are passed on as they are.
    call["function"]["arguments"] = "not json"
    assert function_call_item(call, origins)["input"] == "not json"


PATCH = "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch"
PATCH_TEXT = (
    "<tool_call>\n"
    + json.dumps({"name": "apply_patch", "arguments": {"input": PATCH}})
    + "\n</tool_call>"
)


def test_custom_tool_calls_through_the_sdk_whole_and_streamed(sdk_for: Any) -> None:
    """What Codex reads back when it offers `apply_patch` as a custom (free-form) tool."""
    sdk = sdk_for(PATCH_TEXT)
    response = sdk.responses.create(model="m", input="add a.txt", tools=[PATCH_TOOL])
    (call,) = response.output
    assert call.type == "custom_tool_call" and call.name == "apply_patch"
    assert call.input == PATCH and call.call_id.startswith("call_")
    kinds, done = [], None
    with sdk.responses.stream(model="m", input="add a.txt", tools=[PATCH_TOOL]) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.custom_tool_call_input.done":
                done = event.input
        final = stream.get_final_response()
    assert done == PATCH
    assert "response.custom_tool_call_input.delta" in kinds
    assert "response.function_call_arguments.delta" not in kinds
    assert [(item.type, item.input) for item in final.output] == [("custom_tool_call", PATCH)]
    # The Responses API names a custom tool to force as {"type": "custom", "name": ...}.
    assert openai_choice({"type": "custom", "name": "apply_patch"}) == ("apply_patch", True)


def test_custom_tool_call_items_come_back_as_a_call_and_its_output() -> None:
    messages = to_chat_messages(
        [
            {"type": "message", "role": "user", "content": "add a.txt"},
            {"type": "custom_tool_call", "call_id": "call_7", "name": "apply_patch", "input": "P"},
            {"type": "custom_tool_call_output", "call_id": "call_7", "output": "Done!"},
        ]
    )
    assert [m.role for m in messages] == ["user", "assistant", "tool"]
    (call,) = messages[1].tool_calls or []
    assert (call.id, call.function.name) == ("call_7", "apply_patch")
    assert json.loads(call.function.arguments) == {"input": "P"}
    assert (messages[2].tool_call_id, messages[2].content) == ("call_7", "Done!")
    with pytest.raises(InvalidRequestError) as error:
        to_chat_messages([{"type": "custom_tool_call", "call_id": "c", "name": "n", "input": 3}])
    assert error.value.param == "input.0.input"


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
