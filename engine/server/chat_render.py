"""Normalises OpenAI chat messages and renders them through the checkpoint's own chat template."""

from __future__ import annotations

import json
from typing import Any

from dgpp.engine.errors import InvalidRequestError
from dgpp.engine.server.protocol import ChatMessage

INSTRUCTION_ROLES = ("system", "developer")


def _text(content: str | list[Any] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise InvalidRequestError(
                f"content part type {part.type!r} is not supported by this text model",
                param="messages",
            )
        texts.append(part.text)
    return "\n".join(texts)


def _arguments(raw: str | dict[str, Any]) -> dict[str, Any] | str:
    """Templates expect tool-call arguments as a mapping; OpenAI sends a JSON string."""
    if isinstance(raw, dict):
        return raw
    try:
        parsed = json.loads(raw)
    except json.JSONDecodeError:
        return raw
    return parsed if isinstance(parsed, dict) else raw


def normalise(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Template-ready dicts. `developer` is an instruction role like `system`; consecutive leading
    instruction messages become one system message (joined by a blank line), which every template
    accepts. Later instruction messages keep their place and role."""
    out: list[dict[str, Any]] = []
    leading: list[str] = []
    index = 0
    while index < len(messages) and messages[index].role in INSTRUCTION_ROLES:
        leading.append(_text(messages[index].content))
        index += 1
    if leading:
        out.append({"role": "system", "content": "\n\n".join(leading)})
    for message in messages[index:]:
        role = "system" if message.role == "developer" else message.role
        item: dict[str, Any] = {"role": role, "content": _text(message.content)}
        reasoning = message.reasoning_content or message.reasoning
        if role == "assistant" and reasoning:
            item["reasoning_content"] = reasoning
        if message.tool_calls:
            item["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": _arguments(call.function.arguments),
                    },
                }
                for call in message.tool_calls
            ]
        if role == "tool" and message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        out.append(item)
    return out


def render(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    template_kwargs: dict[str, Any],
    add_generation_prompt: bool,
) -> list[int]:
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tools=tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **template_kwargs,
        )
    except Exception as err:  # jinja2 raises plain exceptions from the template itself
        raise InvalidRequestError(
            f"the model's chat template rejected the messages: {err}", param="messages"
        ) from None
    return list(tokenizer(text, add_special_tokens=False).input_ids)
