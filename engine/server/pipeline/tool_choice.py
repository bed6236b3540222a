"""`tool_choice: "required"` or a named function: the assistant turn is started with the opening
of a Hermes tool call (`<tool_call>` + JSON), so the model continues inside the call. The forced
text is fed to the output parser before the generated text, so it reaches the client only as
part of the parsed tool call.

A template that writes `<tool_call>` blocks (Qwen, Hermes, GLM, Qwen3-Coder) taught its model
this opening, and the call is constrained only when its tools are strict. Any other template
(harmony, DeepSeek, one without tools) did not: there the rest of the call is always
constrained to the tools' names and schemas (structured.py), as vLLM constrains every forced
call, so the answer is a well-formed call whatever the model's own format."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from dgpp.engine.errors import InvalidRequestError

HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"


@dataclass(frozen=True)
class ForcedStart:
    text: str  # appended to the prompt; the parser sees it first
    closing: str  # fed to the parser at the end when the model stopped without writing it
    constrained: bool = False  # the template does not write this format: always constrain


def in_json_string(text: str) -> str:
    """`text` escaped as it appears inside a JSON string (the opening leaves one open)."""
    return json.dumps(text)[1:-1]


def with_forced_start(tokenizer: Any, prompt: list[int], forced: ForcedStart | None) -> list[int]:
    """The rendered prompt followed by the forced tool-call opening, if any."""
    if forced is None:
        return prompt
    return prompt + list(tokenizer(forced.text, add_special_tokens=False).input_ids)


def tool_names(tools: list[dict[str, Any]]) -> list[str]:
    return [str((tool.get("function") or tool).get("name", "")) for tool in tools]


def forced_start(
    chat_template: str, tools: list[dict[str, Any]] | None, name: str | None, required: bool
) -> ForcedStart | None:
    """The forced opening for `required` (any tool) or `name` (that tool); None for auto/none."""
    if not required and name is None:
        return None
    if not tools:
        raise InvalidRequestError("tool_choice requires tools", param="tool_choice")
    if name is not None and name not in tool_names(tools):
        raise InvalidRequestError(
            f"tool_choice names {name!r}, which is not among the tools", param="tool_choice"
        )
    opening = f'{HERMES_OPEN}\n{{"name": "'
    if name is not None:
        opening += f'{in_json_string(name)}", "arguments": '
    native = HERMES_OPEN in chat_template
    return ForcedStart(text=opening, closing=f"\n{HERMES_CLOSE}", constrained=not native)


def openai_choice(tool_choice: str | dict[str, Any] | None) -> tuple[str | None, bool]:
    """(named function, required) from OpenAI's `tool_choice`: Chat Completions names the
    function as `{"type": "function", "function": {"name": ...}}`, the Responses API as
    `{"type": "function", "name": ...}` (or `"custom"` for a custom tool)."""
    if tool_choice is None or tool_choice in ("auto", "none"):
        return None, False
    if tool_choice == "required":
        return None, True
    if isinstance(tool_choice, dict) and tool_choice.get("type") in ("function", "custom"):
        function = tool_choice.get("function")
        named = function.get("name") if isinstance(function, dict) else None
        name = named or tool_choice.get("name")
        if isinstance(name, str) and name:
            return name, True
    raise InvalidRequestError(
        "tool_choice must be 'none', 'auto', 'required' or "
        '{"type": "function", "function": {"name": ...}}',
        param="tool_choice",
    )


def anthropic_choice(tool_choice: dict[str, Any] | None) -> tuple[str | None, bool]:
    """(named tool, required) from Anthropic's `tool_choice`."""
    kind = (tool_choice or {}).get("type", "auto")
    if kind in ("auto", "none"):
        return None, False
    if kind == "any":
        return None, True
    if kind == "tool" and isinstance((tool_choice or {}).get("name"), str):
        return str(tool_choice["name"]), True  # type: ignore[index]
    raise InvalidRequestError(
        "tool_choice type must be auto, any, tool (with name) or none", param="tool_choice"
    )
