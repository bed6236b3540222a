"""DeepSeek-V4's chat encoding, for its checkpoints that ship no Jinja chat template (the release
documents the format in Python, `encoding/encoding_dsv4.py`; this is dgpp's own rendering of it).

    <｜begin▁of▁sentence｜>{system}[\\n\\n## Tools ...]<｜User｜>{user}<｜Assistant｜></think>
    {content}[\\n\\n<｜DSML｜tool_calls>...</｜DSML｜tool_calls>]<｜end▁of▁sentence｜>
    <｜User｜><tool_result>{result}</tool_result><｜Assistant｜></think>

- Thinking (`chat_template_kwargs` `thinking` or `enable_thinking`): the turn being answered
  opens `<think>` and earlier answers drop their reasoning, unless tools are offered (then every
  answer keeps it); `reasoning_effort: max` prepends the release's instruction.
- Tools are described after the system prompt (one is made when there is none) with their JSON
  schemas; calls are DSML invokes, a parameter's `string` flag saying whether its value is text.
- There is no tool role: results join a user turn as `<tool_result>` blocks, in the order of
  the calls they answer; consecutive assistant messages are one turn.

`attach` puts it on a tokenizer in place of `apply_chat_template`, with a `chat_template` text
that names its markers (the output format and reasoning detection read them).
"""

from __future__ import annotations

import json
from functools import partial
from typing import Any

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
THINK, END_THINK = "<think>", "</think>"
DSML = "｜DSML｜"
# The release's instruction for `reasoning_effort: max` (its only level with one).
EFFORT = {
    "max": "Reasoning Effort: Absolute maximum with no shortcuts permitted.\nYou MUST be very "
    "thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and "
    "adversarial scenarios.\nExplicitly write out your entire deliberation process, documenting "
    "every intermediate step, considered alternative, and rejected hypothesis to ensure "
    "absolutely no assumption is left unchecked.\n\n",
}
TOOLS = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by \
writing a "<{DSML}tool_calls>" block like the following:

<{DSML}tool_calls>
<{DSML}invoke name="$TOOL_NAME">
<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>
...
</{DSML}invoke>
<{DSML}invoke name="$TOOL_NAME2">
...
</{DSML}invoke>
</{DSML}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types \
(numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK}), you MUST output your complete reasoning \
inside {THINK}...{END_THINK} BEFORE any tool calls or final response.

Otherwise, output directly after {END_THINK} with tool calls or final response.

### Available Tool Schemas

{{schemas}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""
# What `chat_template` says in place of a Jinja template: the markers other parts look for.
TEMPLATE_NOTE = (
    f"dgpp's DeepSeek-V4 encoding (engine/tokenization/chat_dsv4.py): {USER} {ASSISTANT} {THINK} "
    f"{END_THINK} <{DSML}tool_calls> <{DSML}invoke name= <{DSML}parameter"
)


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _text(content: Any, separator: str = "") -> str:
    """A message's text: a string, or the text parts of a content list."""
    if isinstance(content, list):
        parts = [str(p.get("text", "")) for p in content if isinstance(p, dict)]
        return separator.join(parts)
    return "" if content is None else str(content)


def _calls(calls: list[dict[str, Any]]) -> str:
    invokes = []
    for call in calls:
        function = call.get("function", call)
        arguments = function.get("arguments") or {}
        if isinstance(arguments, str):
            arguments = json.loads(arguments) if arguments.strip() else {}
        parameters = "\n".join(
            f'<{DSML}parameter name="{key}" string="{str(isinstance(v, str)).lower()}">'
            f"{v if isinstance(v, str) else _json(v)}</{DSML}parameter>"
            for key, v in arguments.items()
        )
        invokes.append(f'<{DSML}invoke name="{function["name"]}">\n{parameters}\n</{DSML}invoke>')
    return f"\n\n<{DSML}tool_calls>\n" + "\n".join(invokes) + f"\n</{DSML}tool_calls>"


def _reasoning(message: dict[str, Any]) -> str:
    return str(message.get("reasoning_content") or message.get("reasoning") or "")


def _turns(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive assistant messages as one turn; tool results, and a user message after
    them, joined into one user turn as blocks, the results in the order of the calls they
    answer."""
    turns: list[dict[str, Any]] = []
    order: dict[str, int] = {}
    for message in messages:
        role = message.get("role")
        last = turns[-1] if turns else None
        if role == "assistant":
            content, reasoning = _text(message.get("content")), _reasoning(message)
            calls = list(message.get("tool_calls") or [])
            if last is not None and last["role"] == "assistant":
                last["content"] = "\n\n".join(p for p in (last["content"], content) if p)
                last["reasoning"] = "\n\n".join(p for p in (last["reasoning"], reasoning) if p)
                last["tool_calls"] = calls = [*last["tool_calls"], *calls]
            else:
                turns.append(
                    {"role": role, "content": content, "reasoning": reasoning, "tool_calls": calls}
                )
            if calls:
                order = {str(c.get("id", "")): i for i, c in enumerate(calls) if c.get("id")}
            continue
        joins = last is not None and last["role"] == "user" and "blocks" in last
        if role == "tool":
            rank = order.get(str(message.get("tool_call_id", "")), 0)
            block = (
                rank,
                f"<tool_result>{_text(message.get('content'), chr(10) * 2)}</tool_result>",
            )
        elif role == "user" and joins:
            block = (None, _text(message.get("content")))
        else:
            turns.append({"role": role, "content": _text(message.get("content"))})
            continue
        if joins:
            last["blocks"].append(block)
        else:
            turns.append({"role": "user", "blocks": [block]})
    return turns


def _user(turn: dict[str, Any]) -> str:
    if "blocks" not in turn:
        return USER + turn["content"]
    blocks = turn["blocks"]
    results = iter(sorted((b for b in blocks if b[0] is not None), key=lambda b: b[0]))
    texts = [b[1] if b[0] is None else next(results)[1] for b in blocks]
    return USER + "\n\n".join(texts)


def _last_question(turns: list[dict[str, Any]]) -> int:
    return max((i for i, t in enumerate(turns) if t["role"] in ("user", "developer")), default=-1)


def encode(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    thinking: bool = False,
    reasoning_effort: str | None = None,
) -> str:
    """The prompt text of an OpenAI-shaped conversation (see the module's docstring)."""
    turns = _turns(messages)
    drop = not tools  # earlier answers' reasoning dropped, unless tools are offered
    if thinking and drop:  # and instructions before the question answered
        asked = _last_question(turns)
        turns = [t for i, t in enumerate(turns) if t["role"] != "developer" or i >= asked]
    if tools:
        if not turns or turns[0]["role"] != "system":
            turns.insert(0, {"role": "system", "content": ""})
        schemas = "\n".join(_json(tool.get("function", tool)) for tool in tools)
        turns[0] = {**turns[0], "tools": TOOLS.replace("{schemas}", schemas)}
    asked = _last_question(turns)
    prompt = BOS + (EFFORT.get(reasoning_effort or "", "") if thinking else "")
    for index, turn in enumerate(turns):
        role = turn["role"]
        if role == "system":
            prompt += turn["content"] + ("\n\n" + turn["tools"] if turn.get("tools") else "")
        elif role in ("user", "developer"):
            prompt += _user(turn)
        elif role == "assistant":
            kept = thinking and (not drop or index > asked)
            prompt += (turn["reasoning"] + END_THINK if kept else "") + turn["content"]
            prompt += (_calls(turn["tool_calls"]) if turn["tool_calls"] else "") + EOS
        following = turns[index + 1]["role"] if index + 1 < len(turns) else None
        last = following is None
        if following not in (None, "assistant") or (last and not add_generation_prompt):
            continue
        if role in ("user", "developer") or (role == "system" and (last or following)):
            opens = thinking and (not drop or index >= asked)
            prompt += ASSISTANT + (THINK if opens else END_THINK)
    return prompt


def _apply(tokenizer: Any, conversation: list[dict[str, Any]], **kwargs: Any) -> Any:
    """`apply_chat_template`'s signature over `encode`."""
    options = {**(kwargs.pop("chat_template_kwargs", None) or {}), **kwargs}
    thinking = bool(options.get("thinking", options.get("enable_thinking", False)))
    text = encode(
        conversation,
        options.get("tools"),
        bool(options.get("add_generation_prompt", False)),
        thinking,
        options.get("reasoning_effort"),
    )
    if options.get("tokenize", True):
        return tokenizer(text, add_special_tokens=False).input_ids
    return text


def attach(tokenizer: Any) -> Any:
    """The tokenizer, encoding chats as DeepSeek-V4 does when it has no template of its own."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer
    tokenizer.apply_chat_template = partial(_apply, tokenizer)
    tokenizer.chat_template = TEMPLATE_NOTE
    return tokenizer
