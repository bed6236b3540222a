"""Paths a real model cannot trigger on demand, through a fake engine swapped in with
`app.dependency_overrides[get_state]`: an engine that fails mid-stream or before finishing."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from dgpp.engine.async_engine import EngineFailureError
from dgpp.engine.sampling.sampling_params import SamplingParams
from dgpp.engine.scheduling.request import CompletionOutput, RequestOutput
from dgpp.engine.server.app import create_app
from dgpp.engine.server.core.config import ServerConfig
from dgpp.engine.server.pipeline.state import ServerState
from dgpp.engine.server.routes.deps import get_state
from dgpp.engine.tokenization.tokenizer import load_tokenizer
from tests.engine.server.harness import assert_error
from tests.engine.server.scripted import FakeAdmission, engine_core

CHAT_BODY = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
COMPLETION_BODY = {"model": "fake", "prompt": "hi", "max_tokens": 8}


def _output(request_id: str, prompt: list[int], text: str, delta: str, done: bool) -> RequestOutput:
    completion = CompletionOutput(
        index=0,
        text=text,
        token_ids=tuple(range(len(text))),
        finish_reason="length" if done else None,
    )
    return RequestOutput(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=tuple(prompt),
        outputs=(completion,),
        finished=done,
        text_delta=delta,
        num_new_tokens=1,
    )


class FakeAsyncEngine:
    """The part of `AsyncEngine` the routes use. `mode`: 'ok' finishes "Hello" in two outputs;
    'fail' yields "Hel" and then raises `EngineFailureError`; 'slow' waits before each output;
    'crash' raises a plain RuntimeError."""

    def __init__(self, tokenizer: Any, mode: str, delay: float = 0.0) -> None:
        self.engine = engine_core(tokenizer)
        self.mode = mode
        self.delay = delay
        self.is_running = mode != "dead"
        self.failure = RuntimeError("CUDA error: device lost") if mode == "dead" else None
        self.started: list[str] = []
        self.closed: list[str] = []

    def admit(self, num_requests: int = 1) -> FakeAdmission:
        if self.mode == "dead":
            raise EngineFailureError(f"the engine has failed: {self.failure}")
        return FakeAdmission(num_requests)

    async def generate(
        self,
        prompt: list[int],
        params: SamplingParams,
        request_id: str,
        use_prefix_cache: bool = True,
        admission: Any = None,
    ) -> AsyncIterator[RequestOutput]:
        self.started.append(request_id)
        try:
            if self.mode == "crash":
                raise RuntimeError("unexpected")
            if self.mode == "dead":
                raise EngineFailureError(f"the engine has failed: {self.failure}")
            await asyncio.sleep(self.delay)
            yield _output(request_id, prompt, "Hel", "Hel", False)
            # with n > 1 only the first choice fails; its siblings would run on
            if self.mode == "fail" and request_id.endswith("-0"):
                raise EngineFailureError("the engine failed while serving: boom")
            await asyncio.sleep(self.delay if self.mode != "fail" else 3600)
            yield _output(request_id, prompt, "Hello", "lo", True)
        finally:
            self.closed.append(request_id)


@pytest.fixture(scope="module")
def tokenizer(default_checkpoint: Path) -> Any:
    return load_tokenizer(default_checkpoint)


def _app(tokenizer: Any, mode: str, **config: Any) -> tuple[FastAPI, FakeAsyncEngine]:
    """An app built on a healthy fake, with `get_state` overridden to a fake in `mode`."""
    names = ("fake",)
    healthy = ServerState(FakeAsyncEngine(tokenizer, "ok"), ServerConfig(), names)  # type: ignore[arg-type]
    app = create_app(healthy)
    fake = FakeAsyncEngine(tokenizer, mode, config.pop("delay", 0.0))
    state = ServerState(fake, ServerConfig(served_model_names=names, **config), names)  # type: ignore[arg-type]
    app.dependency_overrides[get_state] = lambda: state
    return app, fake


@pytest.fixture
def failing(tokenizer: Any) -> Iterator[tuple[TestClient, FakeAsyncEngine]]:
    app, fake = _app(tokenizer, "fail")
    with TestClient(app) as client:
        yield client, fake


def _events(client: TestClient, path: str, body: dict) -> list[str]:
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        raw = response.read().decode()
    frames = [frame for frame in raw.split("\n\n") if frame]
    assert all(frame.startswith("data: ") for frame in frames), frames
    return [frame.removeprefix("data: ") for frame in frames]


def test_override_replaces_the_state(tokenizer: Any) -> None:
    app, _ = _app(tokenizer, "ok")
    with TestClient(app) as client:
        reply = client.post("/v1/chat/completions", json=CHAT_BODY).json()
    assert reply["choices"][0]["message"]["content"] == "Hello"
    assert reply["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("path", "body", "text_of"),
    [
        ("/v1/chat/completions", CHAT_BODY, lambda c: c["delta"].get("content")),
        ("/v1/completions", COMPLETION_BODY, lambda c: c["text"]),
    ],
    ids=["chat", "completions"],
)
def test_engine_failure_mid_stream_sends_an_error_event_then_done(
    failing: tuple[TestClient, FakeAsyncEngine], path: str, body: dict, text_of: Any
) -> None:
    client, _ = failing
    events = _events(client, path, body)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])
    assert set(error) == {"error"}
    assert error["error"]["type"] == "server_error"
    assert error["error"]["code"] == "engine_failure"
    assert error["error"]["param"] is None
    assert "boom" in error["error"]["message"]
    chunks = [json.loads(event) for event in events[:-2]]
    assert "".join(text_of(chunk["choices"][0]) or "" for chunk in chunks) == "Hel"
    assert all(chunk["choices"][0]["finish_reason"] is None for chunk in chunks)


def test_engine_failure_of_one_choice_closes_its_siblings(
    failing: tuple[TestClient, FakeAsyncEngine],
) -> None:
    client, fake = failing
    events = _events(client, "/v1/chat/completions", {**CHAT_BODY, "n": 3})
    assert json.loads(events[-2])["error"]["code"] == "engine_failure"
    assert len(fake.started) == 3
    assert sorted(fake.closed) == sorted(fake.started)  # no choice left generating


def test_sdk_raises_on_the_in_band_error(failing: tuple[TestClient, FakeAsyncEngine]) -> None:
    client, _ = failing
    sdk = openai.OpenAI(
        base_url="http://testserver/v1", api_key="x", http_client=client, max_retries=0
    )
    stream = sdk.chat.completions.create(**CHAT_BODY, stream=True)
    with pytest.raises(openai.APIError) as caught:
        for _ in stream:
            pass
    assert caught.value.code == "engine_failure"


@pytest.mark.parametrize(
    ("path", "body"),
    [("/v1/chat/completions", CHAT_BODY), ("/v1/completions", COMPLETION_BODY)],
    ids=["chat", "completions"],
)
def test_engine_failure_without_stream_is_503(
    failing: tuple[TestClient, FakeAsyncEngine], path: str, body: dict
) -> None:
    client, fake = failing
    response = client.post(path, json={**body, "n": 2})
    error = assert_error(response, 503, "engine_failure", None, type_="server_error")
    assert "boom" in error["message"]
    assert response.headers["retry-after"] == "5"
    assert sorted(fake.closed) == sorted(fake.started)


def test_failed_engine_refuses_with_503_and_health_says_failed(tokenizer: Any) -> None:
    app, _ = _app(tokenizer, "dead")
    with TestClient(app) as client:
        response = client.post("/v1/chat/completions", json=CHAT_BODY)
        assert_error(response, 503, "engine_failure", None, type_="server_error")
        health = client.get("/health")
        assert health.status_code == 503
        assert health.json()["state"] == "failed"
        assert "device lost" in health.json()["error"]


def test_unexpected_error_is_a_500_with_an_id_and_the_details_only_in_the_log(
    tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    app, _ = _app(tokenizer, "crash")
    with TestClient(app, raise_server_exceptions=False) as client:
        response = client.post("/v1/chat/completions", json=CHAT_BODY)
    error = assert_error(response, 500, "internal_error", None, type_="server_error")
    error_id = response.headers["x-request-id"]
    assert error_id in error["message"]
    assert "unexpected" not in response.text and "Error" not in response.text  # no exception
    record = next(r for r in caplog.records if error_id in r.getMessage())
    assert record.exc_info is not None and "unexpected" in str(record.exc_info[1])


def test_keep_alive_comments_during_a_slow_step(tokenizer: Any) -> None:
    app, _ = _app(tokenizer, "slow", delay=0.3, keepalive_interval_s=0.05)
    with (
        TestClient(app) as client,
        client.stream("POST", "/v1/chat/completions", json={**CHAT_BODY, "stream": True}) as r,
    ):
        raw = r.read().decode()
    assert ": keep-alive\n\n" in raw
    assert raw.endswith("data: [DONE]\n\n")
    with TestClient(app) as client:
        sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client)
        chunks = list(sdk.chat.completions.create(**CHAT_BODY, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Hello"


# Every generating route streams through the one loop of `pipeline.py`: the same keep-alive and
# failure paths, each in its protocol's shape.
ROUTES = {
    "chat": ("/v1/chat/completions", CHAT_BODY, ": keep-alive\n\n"),
    "completions": ("/v1/completions", COMPLETION_BODY, ": keep-alive\n\n"),
    "responses": ("/v1/responses", {"model": "fake", "input": "hi"}, ": keep-alive\n\n"),
    "messages": (
        "/v1/messages",
        {"model": "fake", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
        'event: ping\ndata: {"type": "ping"}\n\n',
    ),
}


def _raw_stream(app: FastAPI, path: str, body: dict) -> str:
    with TestClient(app) as client, client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        return r.read().decode()


@pytest.mark.parametrize("route", list(ROUTES))
def test_every_route_keeps_a_slow_stream_alive_and_finishes_it(tokenizer: Any, route: str) -> None:
    path, body, keepalive = ROUTES[route]
    app, fake = _app(tokenizer, "slow", delay=0.3, keepalive_interval_s=0.05)
    raw = _raw_stream(app, path, body)
    opening = raw.index(keepalive)  # after the opening events, before the first output
    assert raw.count(keepalive) >= 2 + (route == "messages")  # (a ping opens a message stream)
    assert opening >= 0 and "Hel" in raw[opening:]
    ends = {
        "chat": "data: [DONE]\n\n",
        "completions": "data: [DONE]\n\n",
        "responses": '"type": "response.incomplete"',  # "length": incomplete
        "messages": 'event: message_stop\ndata: {"type": "message_stop"}\n\n',
    }
    assert ends[route] in raw[-2000:]
    assert sorted(fake.closed) == sorted(fake.started)


@pytest.mark.parametrize("route", list(ROUTES))
def test_every_route_ends_a_failed_stream_in_its_protocol(tokenizer: Any, route: str) -> None:
    path, body, _ = ROUTES[route]
    app, fake = _app(tokenizer, "fail")
    raw = _raw_stream(app, path, body)
    assert "boom" in raw
    assert ("overloaded_error" if route == "messages" else "engine_failure") in raw
    last = {
        "chat": "data: [DONE]\n\n",
        "completions": "data: [DONE]\n\n",
        "responses": '"type": "response.failed"',
        "messages": "event: error\n",
    }
    tail = raw.rsplit("\n\n", 2)[-2] + "\n\n" if route in ("chat", "completions") else raw
    assert last[route] in tail
    if route == "messages":
        assert "message_stop" not in raw  # a failed message never says it finished
    assert sorted(fake.closed) == sorted(fake.started)


def test_a_client_gone_while_its_socket_is_full_aborts_at_once(tokenizer: Any) -> None:
    """The client stops reading (the server's send waits) and then disconnects: the response is
    cancelled inside `send`, and every choice must still be aborted at once (a stream left
    suspended kept generating, holding its KV blocks, until the garbage collector ran)."""
    app, fake = _app(tokenizer, "slow", delay=1.0)  # each choice: one output a second
    body = json.dumps({**CHAT_BODY, "n": 2, "stream": True}).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"host", b"testserver")],
        "client": ("127.0.0.1", 50000),
        "server": ("testserver", 80),
    }
    requests = [{"type": "http.request", "body": body, "more_body": False}]
    bodies = 0

    async def run() -> None:
        gone = asyncio.Event()  # as uvicorn: a send waiting on a full socket returns once the
        # connection is lost, and later sends do nothing
        full = asyncio.Event()

        async def receive() -> dict:
            if requests:
                return requests.pop()
            await full.wait()  # the client leaves while the server waits in send
            gone.set()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            nonlocal bodies
            if message["type"] == "http.response.body":
                bodies += 1
                if bodies > 2:  # the role chunks went out; then the socket is full
                    full.set()
                    await gone.wait()

        await asyncio.wait_for(app(scope, receive, send), 10)
        await asyncio.sleep(0.2)  # the choices' tasks see their cancellation (long before their
        # next output, a second after the first)
        # checked here: asyncio.run's end closes every suspended generator, hiding a leak
        assert len(fake.started) == 2
        assert sorted(fake.closed) == sorted(fake.started)  # both choices ended (aborted)

    with TestClient(app):  # the app's startup
        pass
    asyncio.run(run())
