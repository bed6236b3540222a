"""Arrivals at any moment, through the server's engine thread (`AsyncEngine`): the cases of
bench/interactive.py where a request arrives while a step runs.

(d) **arrival offsets**: a long uncached prompt is queued, and a one-line chat request follows
    it after each of several offsets (seconds); the short request's TTFT, from the moment it is
    queued, against its TTFT alone. The long prompt is aborted once the short one has its first
    token, and a fresh long prompt serves the next offset.
(e) **trickle**: a long prompt alone, then the same length again while a short request arrives
    every `period` seconds until the long one has its first token (each short one generating a
    few tokens; nothing else decodes); the long prompt's time to first token against its solo
    time, and the short requests' TTFTs.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable

from dgpp.engine.async_engine import AsyncEngine
from dgpp.engine.llm import LLM
from dgpp.engine.sampling.sampling_params import SamplingParams
from dgpp.engine.scheduling.layer_slices import slice_seconds
from dgpp.engine.scheduling.scheduler import StepPlan

Prompt = Callable[[int], list[int]]  # salt -> prompt token ids


class Arrivals:
    """One engine thread over `llm`'s engine, and requests timed from the moment they are
    queued."""

    def __init__(self, llm: LLM) -> None:
        self.engine = AsyncEngine(llm.engine)
        self.count = 0

    def __enter__(self) -> Arrivals:
        self.engine.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.engine.stop()

    async def ttft(self, prompt: list[int], max_tokens: int, keep: bool = True) -> float:
        """Seconds from queueing `prompt` to its first token; with `keep` the request runs to
        its end before this returns, else it is aborted at the first token."""
        self.count += 1
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        queued = time.perf_counter()
        first = None
        outputs = self.engine.generate(prompt, params, f"a{self.count}", use_prefix_cache=False)
        async for output in outputs:
            if first is None and output.num_new_tokens:
                first = time.perf_counter() - queued
                if not keep:
                    break
        await outputs.aclose()
        assert first is not None
        return first

    async def idle(self) -> None:
        """Until the engine has nothing left (aborted requests leave at the next step)."""
        while self.engine.engine.has_unfinished():
            await asyncio.sleep(0.01)


async def offsets(
    arrivals: Arrivals, long_prompt: Prompt, short: list[int], offsets_s: list[float]
) -> dict[str, float]:
    """(d): the short request's TTFT alone and at each offset after a long prompt."""
    alone = [await arrivals.ttft(short, 4) for _ in range(3)]
    result = {"alone": statistics.median(alone)}
    for index, offset in enumerate(offsets_s):
        long_task = asyncio.create_task(arrivals.ttft(long_prompt(1000 + index), 1, keep=False))
        await asyncio.sleep(offset)
        result[f"{offset:g}"] = await arrivals.ttft(short, 4)
        long_task.cancel()
        await asyncio.gather(long_task, return_exceptions=True)
        await arrivals.idle()
    return result


async def trickle(
    arrivals: Arrivals, long_prompt: Prompt, short: list[int], period_s: float
) -> dict[str, float]:
    """(e): the long prompt's TTFT alone and under a short request every `period_s`."""
    solo = await arrivals.ttft(long_prompt(2000), 1)
    long_task = asyncio.create_task(arrivals.ttft(long_prompt(2001), 1))
    shorts: list[asyncio.Task[float]] = []
    while not long_task.done():
        try:
            await asyncio.wait_for(asyncio.shield(long_task), timeout=period_s)
        except TimeoutError:
            shorts.append(asyncio.create_task(arrivals.ttft(short, 8)))
    ttfts = await asyncio.gather(*shorts)
    await arrivals.idle()
    return {
        "long_alone": solo,
        "long_trickle": long_task.result(),
        "shorts": len(ttfts),
        "short_median": statistics.median(ttfts) if ttfts else float("nan"),
        "short_max": max(ttfts, default=float("nan")),
    }


def run(coroutine_factory: Callable[[Arrivals], object], llm: LLM) -> dict[str, float]:
    with Arrivals(llm) as arrivals:
        return asyncio.run(coroutine_factory(arrivals))  # type: ignore[arg-type]


class Predictions:
    """Each step's wall time against what the step-time model predicted for its plan before it
    ran (the base plus each prompt chunk), by kind of step: does the policy's model hold?"""

    def __init__(self, llm: LLM) -> None:
        self.scheduler = llm.engine.scheduler
        self.ratios: dict[str, list[float]] = {}
        self._observe = self.scheduler.observe

    def __enter__(self) -> Predictions:
        self.scheduler.observe = self._record  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        self.scheduler.observe = self._observe  # type: ignore[method-assign]

    def _record(self, plan: StepPlan, seconds: float) -> None:
        times = self.scheduler.times
        if times.ready and times.decode_step_s is not None:
            prompts = plan.chunks[plan.num_decodes :]
            whole = [c for c in prompts if c.layers is None]
            predicted = sum(times.prompt_seconds(c.num_tokens, c.start) for c in whole)
            predicted += times.decode_step_s if whole or plan.num_decodes else 0.0
            for c in prompts:
                if c.layers is not None:
                    first, stop, total = c.layers
                    predicted += slice_seconds(times, c.num_tokens, c.start, stop - first, total)
            tokens = sum(c.num_tokens for c in whole)
            if plan.num_decodes:
                kind = "decode rows and prompt" if prompts else "decode rows only"
            elif len(whole) < len(prompts):
                kind = "prompt, a layer slice" + (" and more" if whole else "")
            else:
                kind = "prompt, < 64 tokens" if tokens < 64 else "prompt, >= 64 tokens"
            self.ratios.setdefault(kind, []).append(seconds / predicted)
        self._observe(plan, seconds)

    def table(self) -> list[str]:
        rows = [
            "| step kind | steps | actual / predicted: median | p10 | p90 |",
            "|---|---|---|---|---|",
        ]
        for kind, values in sorted(self.ratios.items()):
            ranked = sorted(values)
            p10, p90 = ranked[len(ranked) // 10], ranked[9 * len(ranked) // 10]
            median = statistics.median(ranked)
            rows.append(f"| {kind} | {len(ranked)} | {median:.2f} | {p10:.2f} | {p90:.2f} |")
        return rows
