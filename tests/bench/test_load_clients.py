"""bench/load.py's classifier and checks, against scripted HTTP answers (no server, no model)."""

from __future__ import annotations

import asyncio
import json
import random
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest

# bench/ holds scripts, not a package: import its modules as bench/load.py does.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from load_clients import MIX, KindDeck, Outcome, RequestRecord, send
from load_report import RunFacts, summarise


def _events(*payloads: object, done: bool = True) -> bytes:
    text = "".join(f"data: {json.dumps(p)}\n\n" for p in payloads)
    return (text + ("data: [DONE]\n\n" if done else "")).encode()


def _chunk(content: str = "", finish: str | None = None) -> dict[str, object]:
    return {"choices": [{"index": 0, "delta": {"content": content}, "finish_reason": finish}]}


USAGE = {"choices": [], "usage": {"completion_tokens": 2, "prompt_tokens": 5}}
OVERLOADED = {"error": {"message": "full", "type": "overloaded_error", "code": "overloaded"}}


def _classify(kind: str, answer: Callable[[httpx.Request], httpx.Response]) -> RequestRecord:
    async def go() -> RequestRecord:
        transport = httpx.MockTransport(answer)
        async with httpx.AsyncClient(base_url="http://load.test", transport=transport) as client:
            return await send(client, kind, random.Random(0), "m", timeout_s=5)

    return asyncio.run(go())


def _sse(body: bytes) -> Callable[[httpx.Request], httpx.Response]:
    headers = {"content-type": "text/event-stream"}
    return lambda _: httpx.Response(200, content=body, headers=headers)


@pytest.mark.parametrize(
    ("kind", "answer", "outcome"),
    [
        ("short_stream", _sse(_events(_chunk("a"), _chunk("b", "stop"), USAGE)), "succeeded"),
        ("short_stream", _sse(_events(_chunk("a"), OVERLOADED)), "started_then_overloaded"),
        ("short_stream", _sse(_events(_chunk("a"), {"error": {"code": "x"}})), "stream_error"),
        ("short_stream", _sse(_events(_chunk("a"), done=False)), "lost"),
        ("short_stream", _sse(_events(_chunk("a"))), "lost"),  # [DONE] but no finish_reason
        ("short_whole", lambda _: httpx.Response(200, json={"choices": []}), "lost"),
        (
            "short_whole",
            lambda _: httpx.Response(200, json={"choices": [{"finish_reason": "length"}]}),
            "succeeded",
        ),
        (
            "short_whole",
            lambda _: httpx.Response(503, json=OVERLOADED, headers={"Retry-After": "5"}),
            "refused",
        ),
        ("short_whole", lambda _: httpx.Response(503, json={"error": {"code": "x"}}), "5xx"),
        ("short_whole", lambda _: httpx.Response(500, json={"error": {"code": None}}), "5xx"),
        ("short_whole", lambda _: httpx.Response(400, json={"error": {"code": "x"}}), "4xx"),
    ],
)
def test_each_answer_gets_its_outcome(
    kind: str, answer: Callable[[httpx.Request], httpx.Response], outcome: str
) -> None:
    assert _classify(kind, answer).outcome.value == outcome


def test_a_broken_connection_is_lost() -> None:
    def broken(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadError("reset", request=request)

    record = _classify("short_whole", broken)
    assert record.outcome is Outcome.LOST and "ReadError" in record.detail


@pytest.mark.parametrize("sent_first_token", [False, True])
def test_a_timeout_says_where_the_answer_stopped(sent_first_token: bool) -> None:
    async def stalls() -> AsyncIterator[bytes]:
        if sent_first_token:
            yield _events(_chunk("a"), done=False)
        await asyncio.sleep(60)
        yield b""

    async def go() -> RequestRecord:
        answer = httpx.MockTransport(lambda _: httpx.Response(200, content=stalls()))
        async with httpx.AsyncClient(base_url="http://load.test", transport=answer) as client:
            return await send(client, "short_stream", random.Random(0), "m", timeout_s=0.3)

    record = asyncio.run(go())
    where = "mid-stream" if sent_first_token else "before the first token"
    assert record.outcome is Outcome.LOST and record.detail == f"timeout after 0 s, {where}"


def test_admitted_requests_follow_the_mix_however_many_are_refused() -> None:
    deck, admission, size = KindDeck(seed=3), random.Random(4), sum(w for _, w in MIX)
    admitted: list[str] = []
    while len(admitted) < 3 * size:
        kind = deck.draw()
        if admission.random() < 0.9:  # refused: the card goes back
            deck.put_back(kind)
        else:
            admitted.append(kind)
    for start in range(0, len(admitted), size):
        window = admitted[start : start + size]
        assert {kind: window.count(kind) for kind in set(window)} == dict(MIX)


def test_a_stream_reports_ttft_gaps_and_tokens() -> None:
    body = _events(_chunk("a"), _chunk("b"), _chunk("c", "stop"), USAGE)
    record = _classify("short_stream", _sse(body))
    assert record.ttft_s is not None and len(record.itl_s) == 2
    assert record.completion_tokens == 2


def _facts(rss_end: int, running: int = 0) -> RunFacts:
    idle = {"scheduler": {"running": running, "waiting": 0, "kv_blocks_in_use": 0}}
    return RunFacts(1, 60.0, 20.0, {}, idle, 1.0, [(5.0, 90), (20.0, 100), (60.0, rss_end)])


def test_checks_fail_on_growth_busy_scheduler_and_bad_outcomes() -> None:
    good = [RequestRecord("short_whole", 0.0, Outcome.SUCCEEDED)]
    assert summarise(good, _facts(105))["passed"]
    assert not summarise(good, _facts(106))["checks"]["rss_bounded"]
    assert not summarise(good, _facts(100, running=1))["checks"]["idle_at_end"]
    for bad, check in [
        (Outcome.SERVER_ERROR, "no_5xx"),
        (Outcome.STREAM_ERROR, "no_5xx"),
        (Outcome.STARTED_THEN_OVERLOADED, "no_started_then_overloaded"),
        (Outcome.LOST, "no_lost"),
    ]:
        summary = summarise([*good, RequestRecord("short_stream", 0.0, bad)], _facts(100))
        assert not summary["checks"][check] and not summary["passed"]
