"""hypothesis over the request converters and the chat renderer, with the real SmolLM2 template.

Properties: any valid OpenAI message list (one pydantic accepts) normalises and renders to token
ids, or raises the typed `InvalidRequestError` (a 400 naming its field), never another
exception; the same for Anthropic Messages requests and Responses input items through their
converters, which also keep what they were given (every tool result becomes one `tool`
message tied to its call, every function call one assistant tool call). Budget
`DGPP_FUZZ_EXAMPLES` (default 150) per test, derandomized.
"""

from __future__ import annotations

from typing import Any

import pydantic
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st

from dgpp.engine.errors import InvalidRequestError
from dgpp.engine.server.anthropic.convert import to_chat_messages as anthropic_messages
from dgpp.engine.server.anthropic.protocol import CountTokensRequest
from dgpp.engine.server.chat.render import normalise, probe_template, render
from dgpp.engine.server.openai.protocol import ChatMessage
from dgpp.engine.server.responses.convert import to_chat_messages as responses_messages
from dgpp.engine.server.responses.convert import to_chat_tools
from tests.engine.server.fuzz_checks import fuzz_examples
from tests.engine.server.fuzz_json import JSON, OBJECT, TYPED, WORD, chat_message

FUZZ = settings(max_examples=fuzz_examples(150), derandomize=True, deadline=None)
PART = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "thinking", "redacted_thinking", "image_url"])},
    optional={"text": WORD, "thinking": WORD},
)
MESSAGE = chat_message(PART)


def rendered(tokenizer: Any, messages: list[ChatMessage], **kwargs: Any) -> list[int] | None:
    """The prompt's ids, or None when the typed 400 was raised (it must name a field)."""
    try:
        ids = render(tokenizer, normalise(messages, probe_template(tokenizer)), None, kwargs, True)
    except InvalidRequestError as err:
        assert err.param, err
        event("typed 400")  # shown by --hypothesis-show-statistics
        return None
    event("rendered")
    assert ids and all(isinstance(i, int) for i in ids)
    return ids


def validated(model: type[pydantic.BaseModel], raw: Any) -> Any:
    """`raw` as `model`, or the example is discarded: only valid requests reach a converter."""
    try:
        return model.model_validate(raw)
    except pydantic.ValidationError:
        assume(False)


@FUZZ
@given(raw=st.lists(MESSAGE, min_size=1, max_size=5), thinking=st.booleans())
def test_any_valid_chat_renders_or_is_a_typed_400(
    tokenizer: Any, raw: list[dict[str, Any]], thinking: bool
) -> None:
    messages = [validated(ChatMessage, message) for message in raw]
    rendered(tokenizer, messages, enable_thinking=thinking)


BLOCK = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "thinking", "redacted_thinking", "tool_use", "tool_result"])},
    optional={
        "text": WORD,
        "thinking": WORD,
        "id": WORD,
        "name": WORD,
        "input": JSON,
        "tool_use_id": WORD,
        "content": WORD | st.lists(TYPED, max_size=2),
        "is_error": st.booleans(),
    },
)
ANTHROPIC = st.fixed_dictionaries(
    {
        "model": st.just("m"),
        "messages": st.lists(
            st.fixed_dictionaries(
                {
                    "role": st.sampled_from(["user", "assistant", "system"]),
                    "content": WORD | st.lists(BLOCK, max_size=3),
                }
            ),
            min_size=1,
            max_size=4,
        ),
    },
    optional={"system": WORD | st.lists(BLOCK, max_size=2), "context_management": OBJECT},
)


@FUZZ
@given(raw=ANTHROPIC)
def test_any_valid_anthropic_request_converts_and_renders_or_is_a_typed_400(
    tokenizer: Any, raw: dict[str, Any]
) -> None:
    request = validated(CountTokensRequest, raw)
    try:
        messages = anthropic_messages(request)
    except InvalidRequestError as err:
        assert err.param, err
        return
    results = [
        block
        for message in request.messages
        if message.role == "user" and not isinstance(message.content, str)
        for block in message.content
        if block.type == "tool_result"
    ]
    tool_messages = [m for m in messages if m.role == "tool"]
    assert [m.tool_call_id for m in tool_messages] == [b.tool_use_id for b in results]
    rendered(tokenizer, messages)


ITEM = st.one_of(
    st.fixed_dictionaries(
        {"type": st.just("message"), "role": st.sampled_from(["user", "assistant", "system"])},
        optional={"content": WORD | st.lists(TYPED | WORD, max_size=2)},
    ),
    st.fixed_dictionaries(
        {"type": st.just("function_call"), "call_id": WORD, "name": WORD},
        optional={"arguments": JSON},
    ),
    st.fixed_dictionaries(
        {"type": st.just("function_call_output"), "call_id": WORD},
        optional={"output": WORD | st.lists(TYPED, max_size=2)},
    ),
    st.fixed_dictionaries({"type": st.just("reasoning")}, optional={"summary": JSON}),
    TYPED,
)


@FUZZ
@given(items=WORD | st.lists(ITEM, max_size=5), tools=st.lists(TYPED, max_size=3))
def test_any_responses_input_converts_and_renders_or_is_a_typed_400(
    tokenizer: Any, items: Any, tools: list[dict[str, Any]]
) -> None:
    try:
        messages = responses_messages(items)
        to_chat_tools(tools)
    except InvalidRequestError as err:
        assert err.param, err
        return
    if isinstance(items, list):
        calls = [item for item in items if item.get("type") == "function_call"]
        made = [call.id for m in messages for call in m.tool_calls or []]
        assert made == [call["call_id"] for call in calls]
    if messages:
        rendered(tokenizer, messages)
