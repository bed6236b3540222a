"""The client mix of bench/load.py: looping clients and queue-overflowing bursts, each request
sent as raw HTTP (httpx) and classified into exactly one `Outcome`.

Every request is one `RequestRecord`. A client never retries a request: a refused one is recorded
as refused and the client backs off (a random share of `Retry-After`) before its next pick.
"""

from __future__ import annotations

import asyncio
import enum
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


class Outcome(enum.Enum):
    SUCCEEDED = "succeeded"  # 200, every choice finished; a stream ended with `[DONE]`
    REFUSED = "refused"  # 503 overloaded/draining before the answer started
    ABORTED = "aborted"  # the client cancelled its stream mid-way (intentional)
    DISCONNECTED = "disconnected"  # the client closed before reading the answer (intentional)
    CLIENT_ERROR = "4xx"
    SERVER_ERROR = "5xx"  # any 5xx other than a refusal
    STARTED_THEN_OVERLOADED = "started_then_overloaded"  # 200 stream, then an `overloaded` event
    STREAM_ERROR = "stream_error"  # 200 stream, then an error event other than `overloaded`
    LOST = "lost"  # timeout, broken connection, no `[DONE]`, a whole answer without choices


@dataclass
class RequestRecord:
    kind: str
    start_s: float  # time.monotonic() when sent
    outcome: Outcome = Outcome.LOST
    status: int | None = None
    retry_after: str | None = None
    detail: str = ""  # why lost / the error code: for the report's breakdown
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # gaps between content-bearing events
    completion_tokens: int = 0
    cached_tokens: int = 0
    end_s: float = 0.0


# Two long shared prefixes (~2,960 tokens each with SmolLM2's tokenizer): every long request
# starts with one of them, so every one should hit (bench/load.py primes them) the prefix cache.
def _document(index: int) -> str:
    body = "\n".join(
        f"def service{index}_handler_{i}(request: dict) -> dict:\n"
        f"    return {{'status': {200 + i}, 'id': request['id'], 'shard': {index}}}"
        for i in range(72)
    )
    return f"You review the module service{index}.py below and answer briefly.\n\n{body}\n"


DOCUMENTS = [_document(i) for i in range(2)]
TOPICS = ["rivers", "compilers", "bread", "tides", "chess", "volcanoes", "bees", "trains"]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
# (kind, weight): the mix. `abort` cancels a stream after a few events; `disconnect` closes a
# whole request before its answer arrives.
MIX = [
    ("short_stream", 4),
    ("short_whole", 2),
    ("long_stream", 3),
    ("long_whole", 1),
    ("tools_stream", 1),
    ("tools_whole", 1),
    ("abort", 1),
    ("disconnect", 1),
]


# uvicorn closes idle keep-alive connections after 5 s; a client that reuses one just then sees
# a ReadError for a request the server never received. Dropping idle ones first keeps such
# client-side races out of `LOST`, which must mean the server lost the request.
KEEPALIVE_EXPIRY_S = 4.0
LIMITS = httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_S)


class KindDeck:
    """The mix as a deck of kinds shared by all clients: a request draws a card and a refused
    one puts it back, so the requests the server admits follow the mix to within one deck (14
    cards) however many the queue refuses. A random draw per request would let a short run on a
    slow machine, which admits a few dozen, miss a kind altogether."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)
        self._cards: list[str] = []

    def draw(self) -> str:
        if not self._cards:
            self._cards = [kind for kind, weight in MIX for _ in range(weight)]
            self._rng.shuffle(self._cards)
        return self._cards.pop()

    def put_back(self, kind: str) -> None:
        self._cards.append(kind)


def build_body(kind: str, rng: random.Random, model: str) -> dict[str, Any]:
    """The request body of one `kind` (streamed kinds ask for usage in the last chunk)."""
    if kind.startswith("long"):
        messages = [
            {"role": "system", "content": rng.choice(DOCUMENTS)},
            {"role": "user", "content": f"What does handler {rng.randrange(72)} return?"},
        ]
    elif kind.startswith("tools"):
        city = rng.choice(["Paris", "Lagos", "Lima", "Oslo"])
        messages = [{"role": "user", "content": f"What is the weather in {city}?"}]
    else:
        messages = [{"role": "user", "content": f"Tell me one fact about {rng.choice(TOPICS)}."}]
    body: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "max_tokens": rng.randint(8, 48),
        "temperature": 0.7,
        "stream": not kind.endswith("whole") and kind != "disconnect",
    }
    if kind.startswith("tools"):
        body["tools"] = [WEATHER_TOOL]
        body["tool_choice"] = "auto"
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}
    return body


def _error_code(text: str) -> str:
    try:
        return str(json.loads(text)["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return "unparsed"


def _classify_refusal(record: RequestRecord, response: httpx.Response, text: str) -> None:
    record.status = response.status_code
    record.retry_after = response.headers.get("retry-after")
    record.detail = _error_code(text)
    if response.status_code == 503 and record.detail in ("overloaded", "draining"):
        record.outcome = Outcome.REFUSED
    elif 400 <= response.status_code < 500:
        record.outcome = Outcome.CLIENT_ERROR
    elif response.status_code >= 500:
        record.outcome = Outcome.SERVER_ERROR
    else:
        record.outcome, record.detail = Outcome.LOST, f"unexpected status {response.status_code}"


async def _read_stream(
    record: RequestRecord, response: httpx.Response, abort_after: int | None
) -> None:
    """Consume an SSE stream into `record`; cancel it after `abort_after` content events."""
    last_content: float | None = None
    finished: set[int] = set()
    events = 0
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue  # blank separators and `: keep-alive` comments
        data = line[6:]
        if data == "[DONE]":
            if record.outcome in (Outcome.STARTED_THEN_OVERLOADED, Outcome.STREAM_ERROR):
                return
            if not finished:
                record.detail = "[DONE] without finish_reason"
                return
            record.outcome = Outcome.SUCCEEDED
            return
        chunk = json.loads(data)
        if "error" in chunk:
            code = str(chunk["error"].get("code"))
            record.detail = code
            record.outcome = (
                Outcome.STARTED_THEN_OVERLOADED if code == "overloaded" else Outcome.STREAM_ERROR
            )
            continue
        if chunk.get("usage"):
            record.completion_tokens = chunk["usage"]["completion_tokens"]
            details = chunk["usage"].get("prompt_tokens_details") or {}
            record.cached_tokens = details.get("cached_tokens") or 0
        for choice in chunk.get("choices", []):
            delta = choice.get("delta") or {}
            if delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content"):
                now = time.monotonic()
                if record.ttft_s is None:
                    record.ttft_s = now - record.start_s
                else:
                    record.itl_s.append(now - (last_content or now))
                last_content = now
                events += 1
                if abort_after is not None and events >= abort_after:
                    record.outcome, record.detail = Outcome.ABORTED, "cancelled mid-stream"
                    return  # leaving the `async with` closes the connection mid-stream
            if choice.get("finish_reason") is not None:
                finished.add(choice["index"])
    record.detail = record.detail or "stream ended without [DONE]"


async def send(
    client: httpx.AsyncClient, kind: str, rng: random.Random, model: str, timeout_s: float
) -> RequestRecord:
    """Send one request of `kind` and classify what came back; never raises for the server's
    behaviour (transport errors and timeouts are `LOST`)."""
    record = RequestRecord(kind=kind, start_s=time.monotonic())
    body = build_body(kind, rng, model)
    try:
        if kind == "disconnect":
            await _disconnect(client, body, rng.uniform(0.05, 1.5), record)
        elif body["stream"]:
            abort_after = rng.randint(1, 6) if kind == "abort" else None
            async with asyncio.timeout(timeout_s):
                async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                    if response.status_code != 200:
                        text = (await response.aread()).decode(errors="replace")
                        _classify_refusal(record, response, text)
                    else:
                        record.status = 200
                        await _read_stream(record, response, abort_after)
        else:
            async with asyncio.timeout(timeout_s):
                response = await client.post("/v1/chat/completions", json=body)
            if response.status_code != 200:
                _classify_refusal(record, response, response.text)
            else:
                _classify_whole(record, response)
    except TimeoutError:
        where = "before the first token" if record.ttft_s is None else "mid-stream"
        record.outcome, record.detail = Outcome.LOST, f"timeout after {timeout_s:.0f} s, {where}"
    except (httpx.TransportError, httpx.StreamError) as err:
        record.outcome, record.detail = Outcome.LOST, f"transport: {type(err).__name__}"
    except ValueError as err:  # a body or an event that is not the JSON it must be
        record.outcome, record.detail = Outcome.LOST, f"bad JSON: {err}"[:80]
    record.end_s = time.monotonic()
    return record


def _classify_whole(record: RequestRecord, response: httpx.Response) -> None:
    record.status = 200
    answer = response.json()
    choices = answer.get("choices") or []
    if not choices or any(c.get("finish_reason") is None for c in choices):
        record.outcome, record.detail = Outcome.LOST, "whole answer without finished choices"
        return
    record.outcome = Outcome.SUCCEEDED
    usage = answer.get("usage") or {}
    record.completion_tokens = usage.get("completion_tokens", 0)
    record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


async def _disconnect(
    client: httpx.AsyncClient, body: dict[str, Any], after_s: float, record: RequestRecord
) -> None:
    """A whole request whose client gives up after `after_s`: cancelling the send closes the
    connection, which is how a real client that went away looks to the server."""
    try:
        async with asyncio.timeout(after_s):
            response = await client.post("/v1/chat/completions", json=body)
    except TimeoutError:
        record.outcome, record.detail = Outcome.DISCONNECTED, "closed before the answer"
        return
    # The answer (or a refusal) came before the client gave up: classify it as any whole one.
    if response.status_code != 200:
        _classify_refusal(record, response, response.text)
    else:
        _classify_whole(record, response)


async def client_loop(
    url: str,
    model: str,
    seed: int,
    deadline: float,
    timeout_s: float,
    records: list[RequestRecord],
    deck: KindDeck,
) -> None:
    """One looping client with its own connection pool, until `deadline` (monotonic), taking
    each request's kind from the shared `deck`."""
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=LIMITS) as client:
        while time.monotonic() < deadline:
            kind = deck.draw()
            record = await send(client, kind, rng, model, timeout_s)
            records.append(record)
            if record.outcome is Outcome.REFUSED:
                deck.put_back(kind)
                # Back off a random share of Retry-After so the queue keeps being pushed.
                wait = float(record.retry_after or 1)
                await asyncio.sleep(rng.uniform(0.0, min(wait, 5.0)))


async def burst_loop(
    url: str,
    model: str,
    seed: int,
    deadline: float,
    size: int,
    every_s: float,
    timeout_s: float,
    records: list[RequestRecord],
) -> None:
    """Every `every_s`, `size` short streamed requests at once: more than queue + running, so
    admission must refuse some of them with 503 before any stream starts."""
    rng = random.Random(seed)
    limits = httpx.Limits(max_keepalive_connections=size, keepalive_expiry=KEEPALIVE_EXPIRY_S)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        while time.monotonic() + every_s < deadline:
            await asyncio.sleep(every_s)
            batch = [send(client, "short_stream", rng, model, timeout_s) for _ in range(size)]
            for record in await asyncio.gather(*batch):
                record.kind = "burst"
                records.append(record)
