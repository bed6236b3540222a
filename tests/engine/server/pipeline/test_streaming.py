"""Streams over real sockets: SSE framing, and a client that goes away mid-stream."""

from __future__ import annotations

import itertools
import json
import time

import httpx
import openai
import pytest

from tests.engine.server.conftest import MODEL
from tests.engine.server.harness import RunningServer, assert_still_serving

LONG = {"max_tokens": 400, "ignore_eos": True, "temperature": 0, "stream": True}
MESSAGES = [{"role": "user", "content": "Tell me a very long story."}]


def _events(lines: list[str]) -> list[str]:
    return [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]


def test_sse_framing_of_a_chat_stream(http: httpx.Client) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "temperature": 0}
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["cache-control"] == "no-cache"
        raw = response.read().decode()
    assert raw.endswith("data: [DONE]\n\n")
    frames = [frame for frame in raw.split("\n\n") if frame]
    assert all(frame.startswith("data: ") for frame in frames), frames
    payloads = [json.loads(frame[6:]) for frame in frames[:-1]]
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert payloads[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert len({payload["id"] for payload in payloads}) == 1


def test_completion_stream_matches_non_stream(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    whole = http.post("/v1/completions", json=body).json()
    with http.stream(
        "POST",
        "/v1/completions",
        json={**body, "stream": True, "echo": True, "stream_options": {"include_usage": True}},
    ) as response:
        assert response.status_code == 200
        events = _events(list(response.iter_lines()))
    assert events[-1] == "[DONE]"
    payloads = [json.loads(event) for event in events[:-1]]
    usage = payloads[-1]
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    text = "".join(p["choices"][0]["text"] for p in payloads[:-1])
    assert text == body["prompt"] + whole["choices"][0]["text"]
    assert payloads[-2]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]


def test_streaming_more_than_one_prompt_is_refused(http: httpx.Client) -> None:
    response = http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": ["a", "b"], "max_tokens": 2, "stream": True},
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "prompt"


def test_n_choices_stream_each_choice_to_its_finish(sdk: openai.OpenAI) -> None:
    chunks = list(
        sdk.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=5, n=3, seed=1, stream=True
        )
    )
    texts: dict[int, str] = {0: "", 1: "", 2: ""}
    finishes: dict[int, list[str]] = {0: [], 1: [], 2: []}
    for chunk in chunks:
        (choice,) = chunk.choices
        texts[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finishes[choice.index].append(choice.finish_reason)
    assert all(len(reasons) == 1 for reasons in finishes.values()), finishes
    whole = sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, n=3, seed=1)
    assert [texts[i] for i in range(3)] == [c.message.content for c in whole.choices]


def _disconnect_after_chunks(server: RunningServer, path: str, body: dict, chunks: int) -> None:
    with (
        httpx.Client(base_url=server.url, timeout=60.0) as client,
        client.stream("POST", path, json=body) as response,
    ):
        assert response.status_code == 200
        seen = 0
        lines = []
        stream = response.iter_lines()
        for line in stream:
            lines.append(line)
            if line.startswith("data: {"):
                seen += 1
            if seen >= chunks:
                break
        # Still generating when the client leaves (the role chunks of n > 1 can come before the
        # engine thread has taken the requests in: give it a moment).
        deadline = time.monotonic() + 5.0
        while not server.engine.has_unfinished() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not server.engine.has_unfinished():  # say what the stream said (a rare flake)
            lines += list(itertools.islice(stream, 40))  # the same iterator: one read only
            raise AssertionError(f"nothing left in the engine after {lines[:50]}")
    # the connection is closed here, long before 400 tokens could be generated


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, **LONG}),
        ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "n": 2, **LONG}),
        ("/v1/completions", {"model": MODEL, "prompt": "Once upon a time", **LONG}),
    ],
    ids=["chat", "chat-n2", "completions"],
)
def test_client_disconnect_aborts_and_frees_blocks(
    server: RunningServer, path: str, body: dict
) -> None:
    server.wait_idle()
    started = time.monotonic()
    _disconnect_after_chunks(server, path, body, chunks=3)
    server.wait_idle(timeout=5.0)
    # 400 tokens take far longer than this on the CPU; the request was aborted, not finished
    assert time.monotonic() - started < 10.0
    assert_still_serving(server)


def test_sdk_stream_close_aborts(server: RunningServer, sdk: openai.OpenAI) -> None:
    stream = sdk.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=400,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for index, _ in enumerate(stream):
        if index == 2:
            break
    stream.close()
    server.wait_idle(timeout=5.0)
