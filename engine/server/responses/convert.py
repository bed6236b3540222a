"""Responses API input -> the chat layer's messages and OpenAI chat tools.

Items: messages (roles `user`, `assistant`, `system`, `developer`; content a string or
`input_text` / `output_text` parts), `function_call` (joined to the assistant turn before it),
`function_call_output` (a `tool` message), their `custom_tool_call` / `custom_tool_call_output`
twins, and `reasoning` (the reasoning of the assistant turn that follows). `instructions` become
a leading system message of this request only, as OpenAI does: they are not carried into the
conversation a later `previous_response_id` continues.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from dgpp.engine.errors import InvalidRequestError
from dgpp.engine.server.openai.protocol import ChatMessage, ContentPart
from dgpp.engine.server.openai.tolerant import note_ignored
from dgpp.engine.server.openai.tool_schema import schema_problem

ROLES = ("user", "assistant", "system", "developer")
# A custom tool (free-text input, e.g. Codex's `apply_patch`) is offered to the model as a function
# whose one argument is that text.
CUSTOM_INPUT = "input"
TEXT_PARTS = ("input_text", "output_text", "text", "refusal", "summary_text", "reasoning_text")


def _part_text(part: Any, where: str) -> str:
    if isinstance(part, str):
        return part
    if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        raise InvalidRequestError(
            f"content part type {kind!r} is not supported by this text model", param=where
        )
    text = part.get("text", part.get("refusal", ""))
    if not isinstance(text, str):
        raise InvalidRequestError("a text part needs a string `text`", param=f"{where}.text")
    return text


def _text(content: Any, where: str) -> str | list[ContentPart]:
    """A message's text; with `input_image` parts, its text and image parts in order."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError("content must be a string or a list of parts", param=where)
    if not any(isinstance(part, dict) and part.get("type") == "input_image" for part in content):
        return "\n".join(_part_text(part, f"{where}.{i}") for i, part in enumerate(content))
    return [_part(part, f"{where}.{i}") for i, part in enumerate(content)]


def _part(part: Any, where: str) -> ContentPart:
    """A text part, or an `input_image` as a chat `image_url` part (a URL; no file ids)."""
    if not (isinstance(part, dict) and part.get("type") == "input_image"):
        return ContentPart(type="text", text=_part_text(part, where))
    url = part.get("image_url")
    if not isinstance(url, str) or not url:
        problem = "file_id images are not supported" if part.get("file_id") else "needs one"
        raise InvalidRequestError(
            f"an input_image takes image_url (a data: or http(s) URL); {problem}",
            param=f"{where}.image_url",
        )
    return ContentPart(type="image_url", image_url={"url": url}, origin=where)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"{key} must be a non-empty string", param=f"{where}.{key}")
    return value


def _reasoning_text(item: dict[str, Any]) -> str:
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list):
        return ""
    texts = [p.get("text", "") for p in parts if isinstance(p, dict)]
    return "\n".join(t for t in texts if isinstance(t, str))


def to_chat_messages(items: str | list[dict[str, Any]]) -> list[ChatMessage]:
    """The conversation of a request's `input` (without its `instructions`)."""
    if isinstance(items, str):
        return [ChatMessage(role="user", content=items)]
    out: list[ChatMessage] = []
    reasoning = ""  # from a reasoning item, for the assistant turn that follows
    for index, item in enumerate(items):
        where = f"input.{index}"
        if not isinstance(item, dict):
            raise InvalidRequestError("an input item must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "reasoning":
            reasoning = "\n".join(t for t in (reasoning, _reasoning_text(item)) if t)
        elif kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise InvalidRequestError(
                    f"role must be one of {', '.join(ROLES)}, got {role!r}", param=f"{where}.role"
                )
            message = ChatMessage(role=role, content=_text(item.get("content", ""), where))
            if role == "assistant" and reasoning:
                message.reasoning_content, reasoning = reasoning, ""
            out.append(message)
        elif kind in ("function_call", "custom_tool_call"):
            call = {
                "id": _string(item, "call_id", where),
                "type": "function",
                "function": {
                    "name": _string(item, "name", where),
                    "arguments": _call_arguments(item, kind, where),
                },
            }
            out.append(_with_call(out, call, reasoning))
            reasoning = ""
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id = _string(item, "call_id", where)
            output = _text(item.get("output", ""), f"{where}.output")
            out.append(ChatMessage(role="tool", content=output, tool_call_id=call_id))
        else:
            raise InvalidRequestError(
                f"input item type {kind!r} is not supported (dgpp takes message, "
                "function_call, function_call_output, custom_tool_call, "
                "custom_tool_call_output and reasoning items)",
                param=f"{where}.type",
            )
    return out


def _call_arguments(item: dict[str, Any], kind: str, where: str) -> str | dict[str, Any]:
    """A function call's `arguments`; a custom tool's `input` text as the one argument of the
    function it is offered as."""
    if kind == "custom_tool_call":
        text = item.get("input", "")
        if not isinstance(text, str):
            raise InvalidRequestError("input must be a string", param=f"{where}.input")
        return json.dumps({CUSTOM_INPUT: text}, ensure_ascii=False)
    arguments = item.get("arguments") or "{}"
    if not isinstance(arguments, str | dict):
        raise InvalidRequestError("arguments must be a JSON string", param=f"{where}.arguments")
    return arguments


def _with_call(out: list[ChatMessage], call: dict[str, Any], reasoning: str) -> ChatMessage:
    """An assistant turn with `call` added: the assistant message just before it (text, or
    earlier calls of the same turn) takes it; else a new assistant message. Removes that
    message from `out`, to be appended again by the caller."""
    if out and out[-1].role == "assistant":
        last = out.pop()
        calls = [c.model_dump() for c in last.tool_calls or []] + [call]
        return ChatMessage.model_validate(
            {**last.model_dump(exclude_none=True), "tool_calls": calls}
        )
    return ChatMessage.model_validate(
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [call],
            "reasoning_content": reasoning or None,
        }
    )


def _tool_name(tool: dict[str, Any], where: str, kind: str) -> str:
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequestError(f"a {kind} tool needs a name", param=f"{where}.name")
    return name


def _function(tool: dict[str, Any], where: str) -> dict[str, Any]:
    parameters = tool.get("parameters")
    if parameters is not None and (problem := schema_problem(parameters)):
        raise InvalidRequestError(
            f"{where}.parameters is not a JSON schema: {problem}", param="tools"
        )
    function = {
        "name": _tool_name(tool, where, "function"),
        "description": tool.get("description") or "",
        "parameters": parameters or {"type": "object", "properties": {}},
    }
    if tool.get("strict"):
        function["strict"] = True  # a forced call then follows its parameters (structured)
    return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolOrigins:
    """Where the functions offered to the model came from, for reporting their calls: the
    `namespace` tool of each namespaced function, and the names of custom tools."""

    namespaces: dict[str, str] = field(default_factory=dict)
    custom: frozenset[str] = frozenset()


def _custom(tool: dict[str, Any], where: str) -> dict[str, Any]:
    """A custom tool as a function of one string argument; its grammar (if any) is shown to
    the model in the description, not enforced."""
    name = _tool_name(tool, where, "custom")
    description = tool.get("description") or ""
    if not isinstance(description, str):
        raise InvalidRequestError("description must be a string", param=f"{where}.description")
    form = tool.get("format")
    if isinstance(form, dict) and isinstance(form.get("definition"), str):
        syntax = form.get("syntax") if isinstance(form.get("syntax"), str) else "grammar"
        description += f"\n\nThe input must follow this {syntax} grammar:\n{form['definition']}"
    text = {"type": "string", "description": "the tool's whole input, as free text"}
    parameters = {
        "type": "object",
        "properties": {CUSTOM_INPUT: text},
        "required": [CUSTOM_INPUT],
        "additionalProperties": False,
    }
    function = {"name": name, "description": description.strip(), "parameters": parameters}
    return {"type": "function", "function": function}


def custom_input(arguments: str) -> str:
    """The free-text input of a custom tool's call from the function arguments the model
    wrote: `{"input": "..."}`, else the arguments as they are."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    if isinstance(value, dict) and isinstance(value.get(CUSTOM_INPUT), str):
        return value[CUSTOM_INPUT]
    return arguments


def to_chat_tools(
    tools: list[dict[str, Any]] | None,
) -> tuple[list[dict[str, Any]] | None, ToolOrigins]:
    """Function and custom tools in the Chat Completions shape, and where each came from
    (`ToolOrigins`): the functions of a `namespace` tool are offered by their own names, a call
    of one is reported with its `namespace`; a call of a custom tool is reported as a
    `custom_tool_call`. Other tool types (hosted ones: web search, file search, ...) cannot run
    here and are left out, logged once by type."""
    out: list[dict[str, Any]] = []
    namespaces: dict[str, str] = {}
    custom: set[str] = set()
    for index, tool in enumerate(tools or []):
        kind = tool.get("type")
        where = f"tools.{index}"
        if kind == "function":
            out.append(_function(tool, where))
        elif kind == "custom":
            out.append(_custom(tool, where))
            custom.add(out[-1]["function"]["name"])
        elif kind == "namespace" and isinstance(tool.get("tools"), list):
            for number, inner in enumerate(tool["tools"]):
                if isinstance(inner, dict) and inner.get("type") == "function":
                    out.append(_function(inner, f"{where}.tools.{number}"))
                    namespaces[out[-1]["function"]["name"]] = str(tool.get("name") or "")
        else:
            note_ignored("ResponsesRequest.tools", [f"type {kind!r}"])
    return out or None, ToolOrigins(namespaces, frozenset(custom))
