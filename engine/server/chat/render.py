"""Normalises OpenAI chat messages and renders them through the checkpoint's own chat template."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from dgpp.engine.errors import InvalidRequestError
from dgpp.engine.scheduling.request import PromptIds
from dgpp.engine.server.chat.image_inputs import IMAGE_PARTS, part_url
from dgpp.engine.server.openai.protocol import ChatMessage

INSTRUCTION_ROLES = ("system", "developer")


THINKING_PARTS = ("thinking", "redacted_thinking")


def _text(content: str | list[Any] | None, images: list[str] | None = None) -> Any:
    """The text of a message; Anthropic-style thinking parts are not text (see `_thinking`).
    With `images` (a vision-language model), a message with image parts keeps its parts for
    the template (text and `{"type": "image"}`, where it writes the image's placeholder) and
    their URLs go to `images`, in order."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts: list[dict[str, Any]] = []
    for part in content:
        if part.type in THINKING_PARTS:
            continue
        if part.type in IMAGE_PARTS and images is not None:
            images.append(part_url(part, "messages"))
            parts.append({"type": "image"})
        elif part.type != "text" or part.text is None:
            kind = "model" if part.type not in IMAGE_PARTS else "text-only model"
            raise InvalidRequestError(
                f"content part type {part.type!r} is not supported by this {kind}",
                param=getattr(part, "origin", None) or "messages",  # where the API had it
            )
        else:
            parts.append({"type": "text", "text": part.text})
    if any(part["type"] == "image" for part in parts):
        return parts
    return "\n".join(part["text"] for part in parts)


def _thinking(content: str | list[Any] | None) -> str:
    """Reasoning carried as Anthropic `thinking` parts; redacted payloads and signatures drop."""
    if not isinstance(content, list):
        return ""
    parts = [getattr(part, "thinking", None) for part in content if part.type == "thinking"]
    return "\n".join(part for part in parts if isinstance(part, str))


@dataclass(frozen=True)
class TemplateTraits:
    """What a chat template accepts, found once by rendering probe conversations."""

    multiple_leading_system: bool
    late_system: bool


def probe_template(tokenizer: Any) -> TemplateTraits:
    def accepts(roles: list[str]) -> bool:
        messages = [{"role": role, "content": f"probe {i}"} for i, role in enumerate(roles)]
        try:
            tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception:  # templates signal refusal with plain jinja exceptions
            return False
        return True

    return TemplateTraits(
        multiple_leading_system=accepts(["system", "system", "user"]),
        late_system=accepts(["user", "assistant", "system", "user"]),
    )


def _arguments(raw: str | dict[str, Any]) -> dict[str, Any] | str:
    """Templates expect tool-call arguments as a mapping; OpenAI sends a JSON string."""
    if isinstance(raw, dict):
        return raw
    try:
        parsed = json.loads(raw)
    except json.JSONDecodeError:
        return raw
    return parsed if isinstance(parsed, dict) else raw


def normalise(
    messages: list[ChatMessage], traits: TemplateTraits, images: list[str] | None = None
) -> list[dict[str, Any]]:
    """Template-ready dicts that never turn valid OpenAI input into a template error.

    - Image parts (where `images` collects their URLs: a vision-language model) stay parts of
      their message's content; for a text-only model they are refused.

    - `developer` is an instruction role: it becomes `system`.
    - Consecutive leading instruction messages stay separate where the template accepts several
      system messages, else they are merged in order, joined by a blank line.
    - A later instruction message keeps its place: as `system` where the template allows it, else
      as a `user` message with the same content. Converting in place (never hoisting it into the
      leading system message) keeps each turn's prompt a prefix of the next turn's, which is what
      makes the prefix cache work for agents that append system messages mid-conversation.
    """
    out: list[dict[str, Any]] = []
    index = 0
    leading: list[str] = []
    while index < len(messages) and messages[index].role in INSTRUCTION_ROLES:
        content = messages[index].content
        images_here = isinstance(content, list) and any(p.type in IMAGE_PARTS for p in content)
        if images is not None and images_here:
            raise InvalidRequestError(
                "images in system messages are not supported; send them in a user message",
                param="messages",
            )
        leading.append(_text(content))
        index += 1
    if len(leading) > 1 and not traits.multiple_leading_system:
        leading = ["\n\n".join(leading)]
    out.extend({"role": "system", "content": text} for text in leading)
    late_role = "system" if traits.late_system else "user"
    for message in messages[index:]:
        role = late_role if message.role in INSTRUCTION_ROLES else message.role
        item: dict[str, Any] = {"role": role, "content": _text(message.content, images)}
        if role == "assistant":
            reasoning = message.reasoning_content or message.reasoning or _thinking(message.content)
            if reasoning:
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
    hint_system: bool = False,
) -> PromptIds:
    """The prompt's token ids; with `hint_system`, hinted at the end of its leading system
    messages (and tools), where a hybrid model's prefix cache snapshots its state."""
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
    ids = list(tokenizer(text, add_special_tokens=False).input_ids)
    hint = system_prefix(tokenizer, messages, tools, template_kwargs, ids) if hint_system else None
    return PromptIds(ids, () if hint is None else (hint,))


def system_prefix(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    template_kwargs: dict[str, Any],
    ids: list[int],
) -> int | None:
    """How many of `ids` the leading system messages render to on their own, when the whole
    prompt starts with exactly those tokens (templates that render the system part alike with
    or without what follows); None otherwise, or when there is no system message."""
    count = 0
    while count < len(messages) and messages[count].get("role") in INSTRUCTION_ROLES:
        count += 1
    if not count or count == len(messages):
        return None
    try:
        text = tokenizer.apply_chat_template(
            messages[:count], tools=tools, tokenize=False, **template_kwargs
        )
    except Exception:  # a template that insists on a user turn: no hint
        return None
    prefix = list(tokenizer(text, add_special_tokens=False).input_ids)
    return len(prefix) if 0 < len(prefix) < len(ids) and ids[: len(prefix)] == prefix else None
