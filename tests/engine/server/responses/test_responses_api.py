"""The OpenAI Responses API through the official `openai` SDK over real sockets on the default
model: create, stream (the SDK's own accumulator), stored responses and previous_response_id,
retrieve and delete, and the errors of bad input."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.engine.server.conftest import MODEL
from tests.engine.server.harness import RunningServer, assert_error, assert_still_serving

PATH = "/v1/responses"


@pytest.fixture(autouse=True)
def _still_serving_afterwards(server: RunningServer) -> object:
    yield
    assert_still_serving(server)


def test_create_returns_a_response_object(sdk: openai.OpenAI) -> None:
    response = sdk.responses.create(
        model=MODEL,
        instructions="Answer in one short sentence.",
        input=[
            {"role": "developer", "content": "Be friendly."},
            {"role": "user", "content": [{"type": "input_text", "text": "Say hi."}]},
        ],
        max_output_tokens=24,
        temperature=0,
    )
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status in ("completed", "incomplete") and response.model == MODEL
    assert response.output_text
    (message,) = [item for item in response.output if item.type == "message"]
    assert message.role == "assistant" and message.content[0].type == "output_text"
    usage = response.usage
    assert usage is not None and usage.input_tokens > 10 and 0 < usage.output_tokens <= 24
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert response.instructions == "Answer in one short sentence."


def test_a_short_budget_makes_an_incomplete_response(sdk: openai.OpenAI) -> None:
    response = sdk.responses.create(
        model=MODEL, input="Count from one to fifty.", max_output_tokens=3, temperature=0
    )
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None and response.usage.output_tokens == 3


def test_stream_events_build_the_same_response(sdk: openai.OpenAI) -> None:
    kinds, deltas, numbers = [], [], []
    # A budget the greedy answer fits in: the SDK's accumulator wants `response.completed`.
    with sdk.responses.stream(
        model=MODEL, input="Say hi.", max_output_tokens=200, temperature=0
    ) as stream:
        for event in stream:
            kinds.append(event.type)
            numbers.append(event.sequence_number)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-1] == "response.completed"
    assert {"response.output_text.done", "response.output_item.done"} <= set(kinds)
    assert numbers == list(range(len(numbers)))
    assert final.output_text == "".join(deltas) and final.output_text
    plain = sdk.responses.create(model=MODEL, input="Say hi.", max_output_tokens=200, temperature=0)
    assert plain.output_text == final.output_text  # greedy: streamed equals whole


def test_previous_response_id_continues_the_conversation(sdk: openai.OpenAI) -> None:
    first = sdk.responses.create(
        model=MODEL, input="My name is Ada.", max_output_tokens=8, temperature=0
    )
    second = sdk.responses.create(
        model=MODEL,
        input="What is my name?",
        previous_response_id=first.id,
        max_output_tokens=8,
        temperature=0,
    )
    assert first.usage is not None and second.usage is not None
    # The second prompt holds the first turn (its input and its answer) and the new question.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.previous_response_id == first.id
    fetched = sdk.responses.retrieve(first.id)
    assert fetched.id == first.id and fetched.output_text == first.output_text
    deleted = sdk.responses.delete(first.id)
    assert deleted is None  # the SDK returns nothing for a 200
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(first.id)


def test_an_unknown_previous_response_is_a_404_naming_it(http: httpx.Client) -> None:
    body = {"model": MODEL, "input": "hi", "previous_response_id": "resp_nope"}
    error = assert_error(
        http.post(PATH, json=body), 404, "response_not_found", "previous_response_id"
    )
    assert "resp_nope" in error["message"]
    assert_error(http.get(f"{PATH}/resp_nope"), 404, "response_not_found", "response_id")
    assert_error(http.delete(f"{PATH}/resp_nope"), 404, "response_not_found", "response_id")


def test_store_false_keeps_nothing(sdk: openai.OpenAI) -> None:
    response = sdk.responses.create(
        model=MODEL, input="hi", max_output_tokens=2, store=False, temperature=0
    )
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(response.id)


@pytest.mark.parametrize(
    ("fields", "code", "param"),
    [
        ({"input": [{"type": "computer_call", "id": "x"}]}, "invalid_value", "input.0.type"),
        ({"input": [{"role": "wizard", "content": "x"}]}, "invalid_value", "input.0.role"),
        (
            {"input": [{"type": "function_call", "name": "ls", "arguments": "{}"}]},
            "invalid_value",
            "input.0.call_id",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "invalid_value",
            "input.0.0",
        ),
        ({"input": []}, "invalid_value", "input"),
        ({"input": "hi", "background": True}, "invalid_value", "background"),
        ({"input": "hi", "max_output_tokens": 0}, "invalid_value", "max_output_tokens"),
        ({"input": "hi", "tool_choice": "required"}, "invalid_value", "tool_choice"),
        ({"input": 7}, "invalid_type", "input"),
        (  # found by a hostile-input probe: a tool whose parameters are no JSON schema
            {
                "input": "hi",
                "tools": [
                    {
                        "type": "function",
                        "name": "f",
                        "parameters": {"type": "object", "properties": 5},
                    }
                ],
            },
            "invalid_value",
            "tools",
        ),
    ],
)
def test_bad_requests_name_the_field(
    http: httpx.Client, fields: dict, code: str, param: str
) -> None:
    response = http.post(PATH, json={"model": MODEL, "max_output_tokens": 2, **fields})
    assert_error(response, 400, code, param)


def test_unknown_model_and_malformed_json(http: httpx.Client) -> None:
    assert_error(
        http.post(PATH, json={"model": "gpt-9", "input": "hi"}), 404, "model_not_found", "model"
    )
    bad = http.post(PATH, content=b"{", headers={"content-type": "application/json"})
    assert_error(bad, 400, "invalid_json", None)


def test_a_stream_on_a_prompt_over_the_context_is_refused_before_it_starts(
    http: httpx.Client,
) -> None:
    body = {"model": MODEL, "input": "hello " * 600, "stream": True}
    response = http.post(PATH, json=body)
    assert_error(response, 400, "context_length_exceeded", "input")
    assert response.headers["content-type"].startswith("application/json")


def test_raw_stream_lines_are_named_events(http: httpx.Client) -> None:
    body = {"model": MODEL, "input": "hi", "stream": True, "max_output_tokens": 4}
    text = http.post(PATH, json=body).text
    blocks = [b for b in text.split("\n\n") if b.strip() and not b.startswith(":")]
    for block in blocks:
        event, data = block.split("\n")
        assert event.startswith("event: ") and data.startswith("data: ")
        assert json.loads(data[6:])["type"] == event[7:]
