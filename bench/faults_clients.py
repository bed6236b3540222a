"""The clients of the fault drills: Chat Completions (streamed or whole) of a given body, alone,
in bursts or looping until told to stop, and a raw-socket reader that takes a stream slower
than the server writes it.

Each request is a `RequestRecord` of bench/load_clients.py, classified by its SSE parser: a 200
stream that carries an error event is `STREAM_ERROR` with the event's code, one cut without
`[DONE]` is `LOST`, a broken connection is `LOST` with `transport: <error>`.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from faults_report import DrillSettings
from faults_server import MODEL
from load_clients import (
    LIMITS,
    Outcome,
    RequestRecord,
    _classify_refusal,
    _classify_whole,
    _read_stream,
)

CHAT = "/v1/chat/completions"
RETRY_PAUSE_S = 0.25  # a looping client's pause after a refusal or a broken connection


def whole_body(body: dict[str, Any]) -> dict[str, Any]:
    """`body` as a whole (non-streamed) request."""
    return {key: value for key, value in body.items() if key != "stream_options"} | {
        "stream": False
    }


def chat_body(text: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    """A streamed chat request that generates exactly `max_tokens` (ignore_eos), greedy."""
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }


async def send_chat(
    client: httpx.AsyncClient,
    body: dict[str, Any],
    timeout_s: float,
    kind: str = "stream",
    abort_after: int | None = None,
) -> RequestRecord:
    """One request, classified: streamed (after `abort_after` content events the client
    leaves), or whole when `body` does not ask for a stream."""
    record = RequestRecord(kind=kind, start_s=time.monotonic())
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", CHAT, json=body) as response:
                if response.status_code == 200 and not body.get("stream"):
                    await response.aread()
                    _classify_whole(record, response)
                elif response.status_code == 200:
                    record.status = 200
                    await _read_stream(record, response, abort_after)
                else:
                    text = (await response.aread()).decode(errors="replace")
                    _classify_refusal(record, response, text)
    except TimeoutError:
        record.detail = f"hung: no end within {timeout_s:.0f} s"
    except (httpx.TransportError, httpx.StreamError) as err:
        record.detail = f"transport: {type(err).__name__}"
    except ValueError as err:
        record.detail = f"bad JSON: {err}"[:80]
    record.end_s = time.monotonic()
    return record


async def stream_loop(
    url: str,
    body: dict[str, Any],
    until: asyncio.Event,
    records: list[RequestRecord],
    timeout_s: float,
    kind: str = "load",
) -> None:
    """One client sending `body` again and again until `until` is set (the request in flight
    then still ends normally)."""
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=LIMITS) as client:
        while not until.is_set():
            record = await send_chat(client, body, timeout_s, kind)
            records.append(record)
            if record.outcome is not Outcome.SUCCEEDED:
                await asyncio.sleep(RETRY_PAUSE_S)


@asynccontextmanager
async def looping_clients(
    url: str, body: dict[str, Any], count: int, timeout_s: float, records: list[RequestRecord]
) -> AsyncIterator[None]:
    """`count` `stream_loop` clients for the body of the `async with`; on leaving it they stop
    after the request each has in flight."""
    until = asyncio.Event()
    loops = [stream_loop(url, body, until, records, timeout_s) for _ in range(count)]
    tasks = [asyncio.create_task(loop) for loop in loops]
    try:
        yield
    finally:
        until.set()
        await asyncio.gather(*tasks)


@asynccontextmanager
async def under_load(
    url: str, settings: DrillSettings, records: list[RequestRecord]
) -> AsyncIterator[None]:
    """`settings.clients` looping streamed clients and one looping whole-request client; the
    body of the `async with` starts once they are mid-stream, the moment to inject a fault."""
    body = chat_body("Tell me a story.", settings.max_tokens)
    timeout_s = settings.request_timeout_s
    async with (
        looping_clients(url, whole_body(body), 1, timeout_s, records),
        looping_clients(url, body, settings.clients, timeout_s, records),
    ):
        await wait_generating(url, 4)
        yield


async def burst(
    url: str, body: dict[str, Any], size: int, timeout_s: float, kind: str = "burst"
) -> list[RequestRecord]:
    """`size` streams of `body` sent at once, each on its own connection."""
    limits = httpx.Limits(max_connections=size, max_keepalive_connections=size)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        return list(
            await asyncio.gather(*(send_chat(client, body, timeout_s, kind) for _ in range(size)))
        )


async def wait_generating(url: str, num_tokens: int, timeout_s: float = 120.0) -> None:
    """Until the server has generated `num_tokens` more tokens with a request running: a fault
    injected then lands mid-stream."""
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        first = (await client.get("/v1/metrics")).json()["scheduler"]["tokens_generated"]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            scheduler = (await client.get("/v1/metrics")).json()["scheduler"]
            if scheduler["running"] and scheduler["tokens_generated"] - first >= num_tokens:
                return
            await asyncio.sleep(0.05)
    raise TimeoutError(f"the server generated fewer than {num_tokens} tokens in {timeout_s} s")


async def slow_reader(
    port: int,
    body: dict[str, Any],
    chunk_bytes: int,
    every_s: float,
    hold_s: float,
    release: asyncio.Event | None = None,
) -> dict[str, Any]:
    """Stream `body` over a socket with a small receive buffer, reading `chunk_bytes` every
    `every_s` for `hold_s` (or until `release` is set), then close it: the server's writes back
    up behind the reader."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: small window
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, ("127.0.0.1", port))
    reader, writer = await asyncio.open_connection(sock=sock, limit=chunk_bytes)
    payload = json.dumps(body).encode()
    writer.write(
        f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    await writer.drain()
    received = bytearray()
    started = time.monotonic()
    released = release or asyncio.Event()
    while time.monotonic() - started < hold_s and not released.is_set():
        data = await reader.read(chunk_bytes)
        if not data:
            break  # the server finished (or closed) the stream
        received += data
        await asyncio.sleep(every_s)
    ended_by_server = reader.at_eof() or b"data: [DONE]" in received
    writer.close()
    status_line = bytes(received).split(b"\r\n", 1)[0].decode(errors="replace")
    return {
        "status_line": status_line,
        "bytes_read": len(received),
        "done_read": b"data: [DONE]" in received,
        "held_s": round(time.monotonic() - started, 2),
        "closed_by": "server" if ended_by_server else "client",
    }
