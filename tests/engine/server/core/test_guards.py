"""Servers with non-default guards: an API key, a small body limit, and no waiting queue."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest

from tests.engine.server.conftest import DEFAULT_ENGINE
from tests.engine.server.harness import (
    RunningServer,
    assert_error,
    assert_still_serving,
    running_server,
)

KEY = "sekret-key"
BODY_LIMIT = 4096
CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]
LONG_STREAM = {"max_tokens": 400, "ignore_eos": True, "temperature": 0, "stream": True}


@pytest.fixture(scope="module")
def guarded(default_checkpoint: Path) -> Iterator[RunningServer]:
    options = {"api_key": KEY, "max_body_bytes": BODY_LIMIT}
    with running_server(default_checkpoint, ("guarded",), DEFAULT_ENGINE, options) as server:
        yield server


@pytest.fixture(scope="module")
def single(default_checkpoint: Path) -> Iterator[RunningServer]:
    """One running request at most and no waiting queue: a second request is refused."""
    engine = {**DEFAULT_ENGINE, "max_concurrency": 1}
    with running_server(default_checkpoint, ("single",), engine, {"queue_limit": 0}) as server:
        yield server


def _chat(model: str, **fields: object) -> dict[str, object]:
    return {"model": model, "messages": HI, "max_tokens": 2, "temperature": 0, **fields}


# --- api key -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Basic {KEY}"},
        {"x-api-key": "wrong"},
        {"Authorization": "Bearer", "x-api-key": "wrong"},
    ],
    ids=["none", "wrong-bearer", "basic", "wrong-x-api-key", "empty-bearer"],
)
def test_missing_or_wrong_key_is_401(guarded: RunningServer, headers: dict[str, str]) -> None:
    for method, path, body in (
        ("POST", CHAT, _chat("guarded")),
        ("GET", "/v1/models", None),
        ("POST", "/tokenize", {"prompt": "x"}),
        ("GET", "/v1/nonexistent", None),
    ):
        response = httpx.request(method, guarded.url + path, json=body, headers=headers)
        assert_error(response, 401, "invalid_api_key", None, type_="authentication_error")
    guarded.wait_idle()


@pytest.mark.parametrize(
    "headers",
    [{"Authorization": f"Bearer {KEY}"}, {"authorization": f"bearer  {KEY}"}, {"x-api-key": KEY}],
    ids=["bearer", "bearer-lowercase", "x-api-key"],
)
def test_right_key_is_served(guarded: RunningServer, headers: dict[str, str]) -> None:
    response = httpx.post(guarded.url + CHAT, json=_chat("guarded"), headers=headers, timeout=60)
    assert response.status_code == 200, response.text
    assert httpx.get(guarded.url + "/v1/models", headers=headers).status_code == 200
    assert_still_serving(guarded, headers)


def test_health_is_open_without_a_key(guarded: RunningServer) -> None:
    response = httpx.get(guarded.url + "/health")
    assert response.status_code == 200
    assert response.json()["state"] == "serving"


def test_sdk_with_and_without_the_key(guarded: RunningServer) -> None:
    with openai.OpenAI(base_url=guarded.url + "/v1", api_key="wrong", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError) as caught:
            client.models.list()
        assert caught.value.code == "invalid_api_key"
    with openai.OpenAI(base_url=guarded.url + "/v1", api_key=KEY, max_retries=0) as client:
        reply = client.chat.completions.create(model="guarded", messages=HI, max_tokens=2)
        assert reply.choices[0].message.content is not None


# --- body limit --------------------------------------------------------------------------------


def test_body_over_the_limit_is_413(guarded: RunningServer) -> None:
    body = _chat("guarded", messages=[{"role": "user", "content": "x" * BODY_LIMIT}])
    for headers in ({}, {"x-api-key": KEY}):  # the size check comes before the key check
        response = httpx.post(guarded.url + CHAT, json=body, headers=headers)
        assert_error(response, 413, "request_too_large", None)
    assert_still_serving(guarded, {"x-api-key": KEY})


def test_body_just_under_the_limit_is_served(guarded: RunningServer) -> None:
    body = _chat("guarded", messages=[{"role": "user", "content": "hi "}])
    size = len(json.dumps(body).encode())
    content = body["messages"][0]["content"] + " " * (BODY_LIMIT - size - 200)  # type: ignore[index]
    body["messages"] = [{"role": "user", "content": content}]
    payload = json.dumps(body).encode()
    assert BODY_LIMIT - 300 < len(payload) <= BODY_LIMIT
    response = httpx.post(
        guarded.url + CHAT,
        content=payload,
        headers={"x-api-key": KEY, "content-type": "application/json"},
        timeout=60,
    )
    assert response.status_code == 200, response.text


def test_chunked_body_over_the_limit_is_413(guarded: RunningServer) -> None:
    payload = json.dumps(
        _chat("guarded", messages=[{"role": "user", "content": "hi" + " " * 4 * BODY_LIMIT}])
    ).encode()

    def chunks() -> Iterator[bytes]:
        for start in range(0, len(payload), 1024):
            yield payload[start : start + 1024]

    response = httpx.post(
        guarded.url + CHAT,
        content=chunks(),
        headers={"x-api-key": KEY, "content-type": "application/json"},
        timeout=60,
    )
    assert_error(response, 413, "request_too_large", None)


# --- overload ----------------------------------------------------------------------------------


@contextmanager
def _one_stream_running(server: RunningServer) -> Iterator[None]:
    """Hold a long stream open, read until the engine is generating for it; close it on exit.

    The line iterator must stay referenced: dropping it closes the connection (httpcore closes
    the stream when its generator is finalised), which would abort the request.
    """
    with (
        httpx.Client(base_url=server.url, timeout=60) as client,
        client.stream("POST", CHAT, json=_chat(server.model, **LONG_STREAM)) as response,
    ):
        assert response.status_code == 200
        events = (line for line in response.iter_lines() if line.startswith("data: "))
        assert '"role": "assistant"' in next(events)
        assert '"content": "' in next(events)  # a generated token: the request is running
        assert server.engine.has_unfinished()
        yield
        assert server.engine.has_unfinished()  # still held while the body ran
        events.close()


@pytest.mark.parametrize("path", [CHAT, "/v1/completions"])
def test_second_request_is_refused_with_503_and_retry_after(
    single: RunningServer, path: str
) -> None:
    single.wait_idle()
    body = _chat("single") if path == CHAT else {"model": "single", "prompt": "hi", "max_tokens": 2}
    with _one_stream_running(single):
        response = httpx.post(single.url + path, json=body, timeout=60)
        assert_error(response, 503, "overloaded", None, type_="overloaded_error")
        assert response.headers["retry-after"] == "5"
    assert_still_serving(single)


def test_sdk_sees_overload_as_a_503(single: RunningServer) -> None:
    with (
        openai.OpenAI(base_url=single.url + "/v1", api_key="x", max_retries=0) as sdk,
        _one_stream_running(single),
    ):
        with pytest.raises(openai.InternalServerError) as caught:
            sdk.chat.completions.create(model="single", messages=HI, max_tokens=2)
        assert caught.value.status_code == 503
        assert caught.value.code == "overloaded"
    assert_still_serving(single)


def test_second_streaming_request_is_refused_with_503(single: RunningServer) -> None:
    with _one_stream_running(single):
        response = httpx.post(single.url + CHAT, json=_chat("single", stream=True))
        assert_error(response, 503, "overloaded", None, type_="overloaded_error")
        assert response.headers["retry-after"] == "5"


def test_overload_leaves_no_pending_request_behind(single: RunningServer) -> None:
    """Many refused requests must not leak queue slots: afterwards one request still runs."""
    with _one_stream_running(single):
        for fields in ({}, {"n": 2}, {"stream": True}):
            for _ in range(3):
                response = httpx.post(single.url + CHAT, json=_chat("single", **fields))
                assert response.status_code == 503
    assert_still_serving(single)
