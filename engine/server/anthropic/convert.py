"""Anthropic Messages requests -> the chat layer's normalised messages and OpenAI-style tools."""

from __future__ import annotations

import json
import re
from typing import Any

from dgpp.engine.errors import InvalidRequestError
from dgpp.engine.server.anthropic.protocol import Block, CountTokensRequest
from dgpp.engine.server.openai.protocol import ChatMessage, ContentPart

# Claude Code starts its system prompt with a per-request billing line such as
# "x-anthropic-billing-header: cc_version=2.1.3; cc_entrypoint=cli; cch=9f2c1;". It changes on
# every request, so it would make every prompt differ from its first token and defeat the prefix
# cache; it carries nothing for the model. Exactly such leading lines are removed.
VOLATILE_HEADER = re.compile(r"\A(?:[ \t]*x-anthropic-billing-header:[^\n]*(?:\n|\Z))+")


def strip_volatile_header(text: str) -> str:
    return VOLATILE_HEADER.sub("", text, count=1)


def _blocks_text(blocks: str | list[Block] | None, where: str) -> str:
    if blocks is None:
        return ""
    if isinstance(blocks, str):
        return blocks
    texts = []
    for block in blocks:
        if block.type == "text":
            texts.append(block.text or "")
        elif block.type not in ("thinking", "redacted_thinking"):
            raise InvalidRequestError(
                f"content block type {block.type!r} is not supported in {where}",
                param="messages",
            )
    return "\n".join(texts)


def _image_part(block: Block, where: str) -> ContentPart:
    """An `image` block (base64 `source`, or a `url` one) as a chat `image_url` part."""
    source = getattr(block, "source", None)
    if not isinstance(source, dict):
        raise InvalidRequestError("an image block needs a source object", param=where)
    if source.get("type") == "base64":
        media, data = source.get("media_type"), source.get("data")
        if not isinstance(media, str) or not isinstance(data, str):
            raise InvalidRequestError(
                "a base64 image source needs media_type and data strings", param=where
            )
        url = f"data:{media};base64,{data}"
        return ContentPart(type="image_url", image_url={"url": url}, origin=where)
    if source.get("type") == "url" and isinstance(source.get("url"), str):
        return ContentPart(type="image_url", image_url={"url": source["url"]}, origin=where)
    raise InvalidRequestError(
        f"image source type {source.get('type')!r} is not supported (base64 or url)", param=where
    )


def _parts(blocks: str | list[Block] | None, where: str) -> str | list[ContentPart]:
    """Text and image blocks: the text alone when there is no image, else chat parts."""
    if not isinstance(blocks, list) or not any(block.type == "image" for block in blocks):
        return _blocks_text(blocks, where)
    parts = []
    for block in blocks:
        if block.type == "image":
            parts.append(_image_part(block, where))
        elif block.type == "text":
            parts.append(ContentPart(type="text", text=block.text or ""))
        else:
            raise InvalidRequestError(
                f"content block type {block.type!r} is not supported in {where}", param=where
            )
    return parts


def system_text(request: CountTokensRequest) -> str | None:
    if request.system is None:
        return None
    text = strip_volatile_header(_blocks_text(request.system, "system"))
    return text or None


def to_chat_messages(request: CountTokensRequest) -> list[ChatMessage]:
    """The conversation as OpenAI chat messages: `tool_result` blocks become `tool` messages,
    `tool_use` blocks assistant tool calls, `thinking` blocks reasoning history (redacted
    thinking and signatures are dropped)."""
    out: list[ChatMessage] = []
    system = system_text(request)
    if system is not None:
        out.append(ChatMessage(role="system", content=system))
    for index, message in enumerate(request.messages):
        where = f"messages.{index}"
        if isinstance(message.content, str):
            out.append(ChatMessage(role=message.role, content=message.content))
            continue
        if message.role == "assistant":
            out.append(_assistant(message.content, where))
            continue
        if message.role == "system":
            text = _blocks_text(message.content, f"{where} system")
            out.append(ChatMessage(role="system", content=text))
            continue
        parts: list[ContentPart] = []
        for block in message.content:
            if block.type == "tool_result":
                if block.tool_use_id is None:
                    raise InvalidRequestError("tool_result needs tool_use_id", param=where)
                result = _parts(block.content, f"{where} tool_result")
                if block.is_error:
                    result = _error(result)
                out.append(ChatMessage(role="tool", content=result, tool_call_id=block.tool_use_id))
            elif block.type in ("text", "image"):
                parts.append(_image_part(block, where) if block.type == "image" else block)
            else:
                raise InvalidRequestError(
                    f"content block type {block.type!r} is not supported in user messages",
                    param=where,
                )
        if parts:
            out.append(ChatMessage(role="user", content=_user_content(parts)))
    return clear_thinking(out, request.context_management)


def _user_content(parts: list[Any]) -> str | list[ContentPart]:
    """A user turn's text blocks joined (as before images), or its parts with its images."""
    if not any(part.type == "image_url" for part in parts):
        return "\n".join(part.text or "" for part in parts)
    return [
        part if part.type == "image_url" else ContentPart(type="text", text=part.text or "")
        for part in parts
    ]


def _error(result: str | list[ContentPart]) -> str | list[ContentPart]:
    if isinstance(result, str):
        return f"Error: {result}"
    return [ContentPart(type="text", text="Error:"), *result]


def _assistant(blocks: list[Block], where: str) -> ChatMessage:
    texts, thinking, calls = [], [], []
    for block in blocks:
        if block.type == "text":
            texts.append(block.text or "")
        elif block.type == "thinking":
            thinking.append(block.thinking or "")
        elif block.type == "redacted_thinking":
            continue
        elif block.type == "tool_use":
            calls.append(
                {
                    "id": block.id,
                    "type": "function",
                    "function": {
                        "name": block.name or "",
                        "arguments": json.dumps(block.input or {}),
                    },
                }
            )
        else:
            raise InvalidRequestError(
                f"content block type {block.type!r} is not supported in assistant messages",
                param=where,
            )
    return ChatMessage.model_validate(
        {
            "role": "assistant",
            "content": "\n".join(texts),
            "tool_calls": calls or None,
            "reasoning_content": "\n".join(thinking) or None,
        }
    )


def to_openai_tools(request: CountTokensRequest) -> list[dict[str, Any]] | None:
    choice = (request.tool_choice or {}).get("type")
    if not request.tools or choice == "none":
        return None
    return [
        {
            "type": "function",
            "function": {
                "name": tool.name,
                "description": tool.description or "",
                "parameters": tool.input_schema,
            },
        }
        for tool in request.tools
    ]


CLEAR_THINKING = "clear_thinking_"  # e.g. clear_thinking_20251015


def clear_thinking(
    messages: list[ChatMessage], management: dict[str, Any] | None
) -> list[ChatMessage]:
    """Apply a `context_management` clear-thinking edit: the reasoning of all but the last
    `keep` thinking turns is dropped (`keep: "all"` keeps every one; without `keep`, the last
    turn's). Other edits (clearing old tool results) are accepted and left to the client."""
    edits = (management or {}).get("edits") or []
    if not isinstance(edits, list):
        raise InvalidRequestError(
            "context_management edits must be a list", param="context_management.edits"
        )
    edit = next(
        (
            e
            for e in edits
            if isinstance(e, dict) and str(e.get("type", "")).startswith(CLEAR_THINKING)
        ),
        None,
    )
    if edit is None:
        return messages
    keep = edit.get("keep", {"type": "thinking_turns", "value": 1})
    if keep == "all":
        return messages
    value = keep.get("value") if isinstance(keep, dict) else None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidRequestError(
            'context_management clear-thinking `keep` must be "all" or '
            '{"type": "thinking_turns", "value": N} with N >= 0',
            param="context_management",
        )
    thinking = [i for i, m in enumerate(messages) if m.role == "assistant" and m.reasoning_content]
    dropped = set(thinking[: max(0, len(thinking) - value)])
    return [
        m.model_copy(update={"reasoning_content": None}) if i in dropped else m
        for i, m in enumerate(messages)
    ]
