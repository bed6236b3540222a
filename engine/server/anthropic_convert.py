"""Anthropic Messages requests -> the chat layer's normalised messages and OpenAI-style tools."""

from __future__ import annotations

import json
import re
from typing import Any

from dgpp.engine.errors import InvalidRequestError
from dgpp.engine.server.anthropic_protocol import Block, CountTokensRequest
from dgpp.engine.server.protocol import ChatMessage

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
        texts: list[str] = []
        for block in message.content:
            if block.type == "tool_result":
                if block.tool_use_id is None:
                    raise InvalidRequestError("tool_result needs tool_use_id", param=where)
                result = _blocks_text(block.content, f"{where} tool_result")
                if block.is_error:
                    result = f"Error: {result}"
                out.append(ChatMessage(role="tool", content=result, tool_call_id=block.tool_use_id))
            elif block.type == "text":
                texts.append(block.text or "")
            else:
                raise InvalidRequestError(
                    f"content block type {block.type!r} is not supported in user messages",
                    param=where,
                )
        if texts:
            out.append(ChatMessage(role="user", content="\n".join(texts)))
    return clear_thinking(out, request.context_management)


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
