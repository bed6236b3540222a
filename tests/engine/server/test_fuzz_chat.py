"""hypothesis over the loosely typed parts of the generation requests, through the HTTP layer.

The OpenAPI schema says only `object` for tools, tool_choice, response_format, chat template
kwargs, Responses input items and Anthropic content blocks and context management, so
schemathesis (test_fuzz_openapi.py) never builds the nested shapes the converters walk. Here
each route gets a valid request whose loose fields are arbitrary JSON drawn from the words the
converters look for. The bar is the same: no 5xx, and a 4xx in the API's error shape that names
its field. Budget `DGPP_FUZZ_EXAMPLES` per route (default 150), derandomized.
"""

from __future__ import annotations

from typing import Any

import pytest
import requests
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from schemathesis.python.asgi import ASGIClient

from dgpp.engine.server.app import create_app
from dgpp.engine.server.core.config import ServerConfig
from dgpp.engine.server.pipeline.state import ServerState
from tests.engine.server.fuzz_checks import TEXT, FuzzEngine, assert_error_shape, fuzz_examples
from tests.engine.server.fuzz_json import JSON, OBJECT, TYPED, WORD, chat_message

EXAMPLES = fuzz_examples(150)
TIMEOUT_S = 10.0  # far beyond any scripted answer: a request this slow is a hang
FUZZ = settings(
    max_examples=EXAMPLES,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def client(tokenizer: Any) -> ASGIClient:
    """A requests session on the app (schemathesis' in-process client), for its read timeout:
    a request that hangs fails the test instead of stalling it. The app has no lifespan work
    (the stats log is off), so the session is not entered."""
    config = ServerConfig(served_model_names=("m",), stats_log_interval_s=0)
    app = create_app(ServerState(FuzzEngine(tokenizer, TEXT), config, ("m",)))  # type: ignore[arg-type]
    return ASGIClient(app)


def check(client: ASGIClient, path: str, body: dict[str, Any]) -> None:
    try:
        response = client.post(path, json=body, timeout=TIMEOUT_S)
    except requests.exceptions.Timeout:
        pytest.fail(f"{path} hung past {TIMEOUT_S} s: {body!r}")
    event(f"status {response.status_code}")  # shown by --hypothesis-show-statistics
    assert response.status_code < 500, f"{body!r} -> {response.status_code} {response.text}"
    if response.status_code >= 400:
        assert_error_shape(path, response.status_code, response.json())


def optional(**fields: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    """A dict holding any subset of `fields`."""
    return st.fixed_dictionaries({}, optional=fields)


CHAT_MESSAGE = chat_message(TYPED)


@FUZZ
@given(
    messages=st.lists(CHAT_MESSAGE, min_size=1, max_size=4),
    extra=optional(
        tools=st.lists(TYPED | OBJECT, max_size=2),
        tool_choice=WORD | OBJECT | TYPED,
        response_format=TYPED,
        chat_template_kwargs=st.dictionaries(st.sampled_from(["enable_thinking", "x"]), JSON),
        reasoning_effort=st.sampled_from(["none", "low", "high"]),
        stream=st.booleans(),
    ),
)
@example(  # found by this test: a tool whose `function` is not an object was a 500
    messages=USER, extra={"tools": [{"type": "function", "function": 5}]}
)
@example(  # found by this test: a named tool_choice whose `function` is not an object
    messages=USER, extra={"tool_choice": {"type": "function", "function": 5}}
)
@example(  # found by hand: a forced call of a function whose parameters are not an object
    messages=USER,
    extra={
        "tools": [{"type": "function", "function": {"name": "ls", "parameters": 5}}],
        "tool_choice": "required",
    },
)
def test_chat_completions(
    client: ASGIClient, messages: list[dict[str, Any]], extra: dict[str, Any]
) -> None:
    check(client, "/v1/chat/completions", {"model": "m", "messages": messages, **extra})


BLOCKS = WORD | st.lists(TYPED, max_size=3)
ANTHROPIC_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system"]), "content": BLOCKS}
)


@FUZZ
@given(
    messages=st.lists(ANTHROPIC_MESSAGE, min_size=1, max_size=4),
    extra=optional(
        system=BLOCKS,
        tools=st.lists(
            st.fixed_dictionaries({"name": WORD}, optional={"input_schema": OBJECT}), max_size=2
        ),
        tool_choice=TYPED,
        context_management=optional(edits=JSON | st.lists(TYPED, max_size=2)),
        thinking=st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled"])}),
        stream=st.booleans(),
    ),
    count_only=st.booleans(),
)
@example(  # found by this test: context_management edits that are not a list were a 500
    messages=USER, extra={"context_management": {"edits": 5}}, count_only=False
)
def test_anthropic_messages(
    client: ASGIClient, messages: list[dict[str, Any]], extra: dict[str, Any], count_only: bool
) -> None:
    body = {"model": "m", "messages": messages, **extra}
    if count_only:
        check(client, "/v1/messages/count_tokens", body)
    else:
        check(client, "/v1/messages", {**body, "max_tokens": 8})


@FUZZ
@given(
    items=WORD | st.lists(TYPED | OBJECT, max_size=4),
    extra=optional(
        instructions=WORD,
        tools=st.lists(TYPED, max_size=2),
        tool_choice=WORD | TYPED,
        text=optional(format=JSON | TYPED),
        stream=st.booleans(),
    ),
)
@example(  # found by this test: a function_call whose arguments are not a string was a 500
    items=[{"type": "function_call", "call_id": "c", "name": "f", "arguments": 5}], extra={}
)
@example(items="hi", extra={"text": {"format": 5}})  # found: a text.format not an object
def test_responses(client: ASGIClient, items: Any, extra: dict[str, Any]) -> None:
    check(client, "/v1/responses", {"model": "m", "input": items, **extra})
