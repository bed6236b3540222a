"""The periodic one-line stats log (`ServerConfig.stats_log_interval_s`; 0 turns it off).

Each line covers the time since the previous one: prompt and generation throughput, the queues,
KV-cache use, and the prefix-cache hit rate in tokens. A quiet interval (no request finished, no
token computed, nothing running or waiting) logs nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass

from dgpp.engine.scheduling.stats import EngineCounters, EngineStats
from dgpp.engine.server.metrics.service import ServiceCounters

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sample:
    at: float  # time.monotonic()
    stats: EngineStats | None  # None while the model loads
    service: ServiceCounters


class StatsLine:
    """Turns consecutive samples into a line, or None when nothing happened in between."""

    def __init__(self, first: Sample) -> None:
        self.last = first

    def next(self, sample: Sample) -> str | None:
        if sample.stats is None:
            return None
        last, self.last = self.last, sample
        now = sample.stats.counters
        before = last.stats.counters if last.stats is not None else EngineCounters()
        prompt = now.prompt_tokens_total - before.prompt_tokens_total
        generated = now.tokens_generated - before.tokens_generated
        finished = sample.service.requests_total - last.service.requests_total
        busy = sample.stats.running + sample.stats.waiting
        if not (prompt or generated or finished or busy):
            return None
        seconds = max(sample.at - last.at, 1e-9)
        if not sample.stats.prefix_cache_enabled:
            hit_rate = "off"
        elif prompt > 0:
            hit = now.prefix_cache.hit_tokens - before.prefix_cache.hit_tokens
            hit_rate = f"{hit / prompt:.1%}"
        else:
            hit_rate = "-"
        spec = ""
        drafted = now.spec_decode.draft_tokens - before.spec_decode.draft_tokens
        if drafted:
            accepted = now.spec_decode.accepted_tokens - before.spec_decode.accepted_tokens
            spec = f", draft acceptance {accepted / drafted:.1%}"
        return (
            f"prompt {prompt / seconds:.1f} tok/s, generation {generated / seconds:.1f} tok/s, "
            f"running {sample.stats.running}, waiting {sample.stats.waiting}, "
            f"KV cache {sample.stats.kv_usage:.1%} used, prefix cache hit rate {hit_rate}"
            f"{spec}, {finished} requests done"
        )


@asynccontextmanager
async def periodic_stats_log(
    interval_s: float,
    stats: Callable[[], EngineStats | None],
    service: Callable[[], ServiceCounters],
) -> AsyncIterator[None]:
    """Log a stats line every `interval_s` seconds while the context is open."""
    if interval_s <= 0:
        yield
        return
    task = asyncio.create_task(_log_forever(interval_s, stats, service), name="dgpp-stats-log")
    try:
        yield
    finally:
        task.cancel()
        with suppress(asyncio.CancelledError):
            await task


def _sample(
    stats: Callable[[], EngineStats | None], service: Callable[[], ServiceCounters]
) -> Sample:
    try:
        snapshot = stats()
    except Exception:
        log.debug("engine stats unavailable", exc_info=True)
        snapshot = None
    return Sample(time.monotonic(), snapshot, service())


async def _log_forever(
    interval_s: float,
    stats: Callable[[], EngineStats | None],
    service: Callable[[], ServiceCounters],
) -> None:
    line = StatsLine(_sample(stats, service))
    while True:
        await asyncio.sleep(interval_s)
        text = line.next(_sample(stats, service))
        if text is not None:
            log.info(text)
