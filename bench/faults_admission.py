"""Fault drills at the server's edge, on one world-1 server with little room (ADMISSION_ARGS):
a full queue, a full KV pool, clients that leave mid-stream, and a client that reads slowly.

Each drill returns a `DrillResult`; `serve_again_s` is measured from the end of the fault (the
burst answered, the clients gone, the reader closed) to the next successful request.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
from faults_clients import burst, chat_body, looping_clients, send_chat, slow_reader, whole_body
from faults_report import DrillResult, DrillSettings, itl_figures, shared_checks
from faults_server import Serve, end_state, serve_again
from load_clients import LIMITS, Outcome, RequestRecord, _disconnect

MAX_CONCURRENCY, QUEUE_LIMIT, KV_TOKENS = 3, 2, 1024
ADMISSION_ARGS = [
    "--max-concurrency",
    str(MAX_CONCURRENCY),
    "--queue-limit",
    str(QUEUE_LIMIT),
    "--kv-capacity",
    str(KV_TOKENS),
    "--max-model-len",
    str(KV_TOKENS),
]
BURST = 8  # > running + queued
# ~420 tokens with the chat template, then GROW more: two fit at admission (27 blocks each of
# 64) but not once both have grown (33 each), so the scheduler must queue or preempt. Each
# prompt starts with its own word: no prefix-cache block is shared between them.
LONG_PROMPT = "word " * 400
FIRST_WORDS = ("apple", "pear", "plum")
GROW = 96
TOO_LONG_PROMPT = "word " * 1100  # more than the whole pool: can never fit
# Generated in ~7-18 s; read at 2 KB/s until the server is idle, at most HOLD_S: <= 120 KB of
# ~200 KB, so the reader is always behind when it closes.
SLOW_TOKENS, HOLD_S = 120, 60.0
OTHERS, OTHERS_S = 2, 8.0
SETTLE_S = 5.0  # a client that left must have its blocks back within this


async def queue_full(serve: Serve, settings: DrillSettings) -> DrillResult:
    fault = f"{BURST} streams at once on room for {MAX_CONCURRENCY} running + {QUEUE_LIMIT} queued"
    result = DrillResult("queue_full", fault)
    body = chat_body("Count to ten.", settings.max_tokens)
    result.records = await burst(serve.url, body, BURST, settings.request_timeout_s)
    result.serve_again_s = await serve_again(serve.url, time.monotonic(), 30)
    result.end = await end_state(serve.url)
    refused = [r for r in result.records if r.status != 200]
    result.checks = shared_checks(result, serve_again_within_s=settings.serve_again_within_s)
    result.checks["some_refused"] = bool(refused)
    result.checks["refused_before_stream_with_retry_after"] = all(
        r.outcome is Outcome.REFUSED and r.detail == "overloaded" and r.retry_after for r in refused
    )
    result.checks["admitted_streams_complete"] = all(
        r.outcome is Outcome.SUCCEEDED for r in result.records if r.status == 200
    )
    return result


async def _peak_use(url: str, until: asyncio.Event, peak: dict[str, int]) -> None:
    """The highest KV use and queue length seen while `until` is unset."""
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        while not until.is_set():
            scheduler = (await client.get("/v1/metrics")).json()["scheduler"]
            for key in ("kv_blocks_in_use", "waiting", "running"):
                peak[key] = max(peak.get(key, 0), scheduler[key])
            await asyncio.sleep(0.1)


async def kv_full(serve: Serve, settings: DrillSettings) -> DrillResult:
    result = DrillResult(
        "kv_full",
        f"{len(FIRST_WORDS)} different ~420-token prompts generating {GROW} tokens each at once "
        f"on a {KV_TOKENS}-token KV pool, and one ~1,100-token prompt that can never fit",
    )
    bodies = [chat_body(f"{word} {LONG_PROMPT}", GROW) for word in FIRST_WORDS]
    peak: dict[str, int] = {}
    until = asyncio.Event()
    sampler = asyncio.create_task(_peak_use(serve.url, until, peak))
    async with httpx.AsyncClient(base_url=serve.url, timeout=None, limits=LIMITS) as client:
        sent = [send_chat(client, body, settings.request_timeout_s) for body in bodies]
        never = send_chat(client, chat_body(TOO_LONG_PROMPT, 8), settings.request_timeout_s)
        result.records = list(await asyncio.gather(*sent, never))
    until.set()
    await sampler
    result.serve_again_s = await serve_again(serve.url, time.monotonic(), 30)
    result.end = await end_state(serve.url)
    *fitting, too_long = result.records
    result.figures = {"peak": peak, "too_long_answer": f"{too_long.status} {too_long.detail}"}
    result.checks = shared_checks(result, serve_again_within_s=settings.serve_again_within_s)
    result.checks["fitting_prompts_complete"] = all(
        r.outcome is Outcome.SUCCEEDED and r.completion_tokens == GROW for r in fitting
    )
    result.checks["never_fitting_refused_precisely"] = (
        too_long.status == 400 and too_long.detail == "context_length_exceeded"
    )
    return result


async def disconnect(serve: Serve, settings: DrillSettings) -> DrillResult:
    result = DrillResult(
        "disconnect",
        f"{settings.clients} streams closed by their clients after 3 content events, "
        "one whole request closed after 1 s",
    )
    before = (await serve.metrics())["service"]
    body = chat_body("Tell me a long story.", 400)
    whole = whole_body(body)
    async with httpx.AsyncClient(base_url=serve.url, timeout=None, limits=LIMITS) as client:
        left = RequestRecord(kind="whole", start_s=time.monotonic())
        streams = [
            send_chat(client, body, settings.request_timeout_s, abort_after=3)
            for _ in range(settings.clients)
        ]
        records = await asyncio.gather(*streams, _disconnect(client, whole, 1.0, left))
    result.records = [r for r in records if r is not None] + [left]
    gone = time.monotonic()
    result.end = await end_state(serve.url)
    result.serve_again_s = await serve_again(serve.url, gone, 30)
    after = result.end["service"]
    result.figures = {"cancelled_by_server": after["cancelled"] - before["cancelled"]}
    result.checks = shared_checks(result, serve_again_within_s=settings.serve_again_within_s)
    result.checks["kv_freed_within_5s"] = result.end["settle_s"] <= SETTLE_S
    result.checks["every_left_request_cancelled"] = result.figures["cancelled_by_server"] == len(
        result.records
    )
    return result


async def slow_reader_drill(serve: Serve, settings: DrillSettings) -> DrillResult:
    """Two clients stream (their ITL measured alone first) while a third takes a big stream
    (top_logprobs 20: ~1.7 KB an event) at 1 KB every 0.5 s, then closes it. The server
    generates it all well before the reader is through: once the others stopped, nothing may stay
    allocated while the reader is still connected. The reader closes once the server is seen idle
    (at most HOLD_S), so a slow host only lengthens the drill."""
    result = DrillResult(
        "slow_reader",
        f"a stream of {SLOW_TOKENS} ~1.7 KB events read at 2 KB/s until the server is idle "
        f"(at most {HOLD_S:.0f} s), then closed, beside {OTHERS} normal streams for the first "
        f"{OTHERS_S:.0f} s",
    )
    body = chat_body("Tell me about rivers.", settings.max_tokens)
    baseline: list[RequestRecord] = []
    async with looping_clients(serve.url, body, OTHERS, settings.request_timeout_s, baseline):
        await asyncio.sleep(4.0)
    big = chat_body("Tell me a long story.", SLOW_TOKENS, logprobs=True, top_logprobs=20)
    before = await serve.metrics()
    release = asyncio.Event()
    reader = asyncio.create_task(slow_reader(serve.port, big, 1024, 0.5, HOLD_S, release))
    async with looping_clients(serve.url, body, OTHERS, settings.request_timeout_s, result.records):
        await asyncio.sleep(OTHERS_S)
    connected = await end_state(serve.url, timeout_s=HOLD_S - OTHERS_S - 3.0)
    release.set()
    slow = await reader
    closed = time.monotonic()
    result.end = await end_state(serve.url)
    after = await serve.metrics()
    result.serve_again_s = await serve_again(serve.url, closed, 30)
    alone, beside = itl_figures(baseline), itl_figures(result.records)
    ended = _ended(before, after, result.records)
    result.figures = {
        "itl_alone_s": alone,
        "itl_beside_slow_reader_s": beside,
        "slow_reader": slow,
        "tokens_generated_for_it": _generated(before, after, result.records),
        "while_reader_connected": {key: connected[key] for key in END_KEYS},
        "its_request_ended_as": ended,
    }
    # A write that blocked the engine would stall the others until the reader closes (tens of s);
    # 5 s leaves room for a busy host's hiccups.
    bound = max(5.0, 4 * (alone["p95"] or 0.0))
    result.checks = shared_checks(result, serve_again_within_s=settings.serve_again_within_s)
    result.checks["others_not_stalled"] = beside["max"] is not None and beside["max"] <= bound
    result.checks["others_complete"] = bool(result.records) and all(
        r.outcome is Outcome.SUCCEEDED for r in result.records
    )
    # The drill is only one if the reader was still behind when it closed (no `[DONE]` read).
    result.checks["reader_was_behind"] = not slow["done_read"]
    result.checks["freed_while_reader_connected"] = bool(connected["idle"])
    result.checks["its_request_ended"] = sum(ended.values()) == 1
    return result


END_KEYS = ("idle", "running", "waiting", "kv_blocks_in_use")


def _ended(
    before: dict[str, Any], after: dict[str, Any], others: list[RequestRecord]
) -> dict[str, int]:
    """How the server counted the slow reader's request (the others all succeeded)."""
    delta = {
        key: after["service"][key] - before["service"][key]
        for key in ("succeeded", "failed", "cancelled")
    }
    delta["succeeded"] -= sum(1 for record in others if record.outcome is Outcome.SUCCEEDED)
    return delta


def _generated(before: dict[str, Any], after: dict[str, Any], others: list[RequestRecord]) -> int:
    """Tokens the server generated for the slow reader: all of them less the other clients'."""
    total = after["scheduler"]["tokens_generated"] - before["scheduler"]["tokens_generated"]
    return total - sum(record.completion_tokens for record in others)


ADMISSION_DRILLS = {
    "queue_full": queue_full,
    "kv_full": kv_full,
    "disconnect": disconnect,
    "slow_reader": slow_reader_drill,
}
