"""Starts real dgpp servers (engine thread + uvicorn on loopback) for the HTTP tests."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from dgpp.engine.async_engine import AsyncEngine
from dgpp.engine.configuration.engine_config import EngineConfig
from dgpp.engine.engine import LLMEngine
from dgpp.engine.planning.resolved import resolve
from dgpp.engine.server.app import create_app
from dgpp.engine.server.core.config import ServerConfig
from dgpp.engine.server.pipeline.state import ServerState


def linked_checkpoint(source: Path, folder: Path, chat_template: str) -> Path:
    """`source`'s weights and tokenizer (linked, not copied) behind another chat template."""
    for item in source.iterdir():
        if item.name != "chat_template.jinja":
            os.symlink(item, folder / item.name)
    (folder / "chat_template.jinja").write_text(chat_template)
    return folder


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class RunningServer:
    port: int
    engine: LLMEngine
    async_engine: AsyncEngine
    state: ServerState

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def model(self) -> str:
        return self.state.model_name

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Wait until the engine has no request in flight and every KV block is back."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.is_idle():
                return
            time.sleep(0.02)
        raise AssertionError(
            f"engine not idle after {timeout} s: unfinished={self.engine.has_unfinished()}, "
            f"used blocks={self.engine.block_manager.num_used_blocks}, "
            f"pending={self.async_engine._num_pending}"
        )

    def is_idle(self) -> bool:
        return (
            not self.engine.has_unfinished()
            and self.engine.block_manager.num_used_blocks == 0
            and self.async_engine._num_pending == 0
        )


@contextmanager
def running_server(
    checkpoint: Path,
    names: tuple[str, ...],
    engine_options: dict[str, Any] | None = None,
    server_options: dict[str, Any] | None = None,
) -> Iterator[RunningServer]:
    """An `LLMEngine` behind `AsyncEngine` behind uvicorn, as `dgpp serve` builds it."""
    port = free_port()
    engine = LLMEngine(
        resolve(EngineConfig(model=str(checkpoint), **(engine_options or {})), checkpoint)
    )
    config = ServerConfig(port=port, served_model_names=names, **(server_options or {}))
    async_engine = AsyncEngine(engine, queue_limit=config.queue_limit)
    async_engine.start()
    state = ServerState(async_engine, config, names)
    server = uvicorn.Server(
        uvicorn.Config(create_app(state), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    try:
        _wait_for_health(f"http://127.0.0.1:{port}/health", thread)
        yield RunningServer(port, engine, async_engine, state)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        async_engine.stop()
        assert not thread.is_alive(), "uvicorn did not stop"


@contextmanager
def server_settings(server: RunningServer, **changes: Any) -> Iterator[None]:
    """Run the block with some `ServerConfig` settings of a running server changed (what the
    routes read; the keys and limits the app captured at start stay)."""
    saved = server.state.config
    server.state.config = replace(saved, **changes)
    try:
        yield
    finally:
        server.state.config = saved


@contextmanager
def served_names(server: RunningServer, names: tuple[str, ...]) -> Iterator[None]:
    """Run the block with the server answering to `names` (names or patterns)."""
    saved = server.state.served_model_names
    server.state.served_model_names = names
    try:
        yield
    finally:
        server.state.served_model_names = saved


def _wait_for_health(url: str, thread: threading.Thread, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not thread.is_alive():
            raise RuntimeError("the uvicorn thread exited before serving")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{url} did not answer within {timeout} s")


def error_of(response: httpx.Response) -> dict[str, Any]:
    """The OpenAI-style `error` object of a response, checked to have exactly the four keys."""
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    return error


def assert_error(
    response: httpx.Response,
    status: int,
    code: str | None,
    param: str | None,
    type_: str = "invalid_request_error",
) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = error_of(response)
    assert (error["type"], error["code"], error["param"]) == (type_, code, param), error
    return error


def assert_still_serving(server: RunningServer, headers: dict[str, str] | None = None) -> None:
    """A normal request succeeds, and once idle the engine holds no request and no KV block."""
    server.wait_idle()  # a client that just went away is noticed asynchronously
    response = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={
            "model": server.model,
            "messages": [{"role": "user", "content": "Say hi."}],
            "max_tokens": 2,
            "temperature": 0,
        },
        headers=headers,
        timeout=60.0,
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1
    server.wait_idle()
