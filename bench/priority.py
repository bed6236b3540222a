"""Request priority under load (issue 66): an interactive client beside background streams, with
priorities and without them (every request at 0: the order dgpp had before), in one run.

    python bench/priority.py [--streams 8] [--background-tokens 4000] [--interactive-tokens 1000]
        [--requests 20] [--none-requests 5] [--max-tokens 32] [--modes priority,none]

The default model (SmolLM2-135M, float32) on this machine's CPU, one engine thread
(`AsyncEngine`, as the server drives it) per mode. First the interactive request alone,
`--requests` times (its solo TTFT and inter-token latency); then `--streams` background streams,
each submitting distinct `--background-tokens`-token prompts back to back at priority 10, and
beside them the same interactive requests one after another at priority 0 (mode `priority`), or
everything at 0 (mode `none`, `--none-requests` of them: on a CPU each waits for the background
prefills ahead of it, minutes). Reported: the interactive TTFT and ITL, p50 and p95, as ratios to
solo; every background request's completion and its worst wait (queued to first token).
Progress goes to stderr, each mode's row as soon as it is done.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from dataclasses import dataclass, field

from dgpp.appliance.models.default import install_default
from dgpp.engine.async_engine import AsyncEngine
from dgpp.engine.llm import LLM
from dgpp.engine.sampling.sampling_params import SamplingParams

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven"]


def prompt_of(llm: LLM, tokens: int, salt: int) -> list[int]:
    """`tokens` distinct (uncached) prompt tokens."""
    text = " ".join(
        WORDS[(i * 7 + salt) % len(WORDS)] + str((i + salt) % 97) for i in range(tokens)
    )
    return list(llm.tokenizer(text).input_ids[:tokens])


@dataclass
class Timed:
    ttft: float
    itl: float  # mean gap between tokens after the first


@dataclass
class Background:
    waits: list[float] = field(default_factory=list)  # queued to first token, per request
    completed: int = 0
    started: int = 0


class Client:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine, self.count = engine, 0

    async def run(self, prompt: list[int], max_tokens: int, priority: int) -> Timed:
        self.count += 1
        params = SamplingParams(
            max_tokens=max_tokens, temperature=0, ignore_eos=True, priority=priority
        )
        queued, stamps = time.perf_counter(), []
        outputs = self.engine.generate(prompt, params, f"p{self.count}", use_prefix_cache=False)
        async for output in outputs:
            if output.num_new_tokens:
                stamps.append(time.perf_counter())
        gaps = len(stamps) - 1
        itl = (stamps[-1] - stamps[0]) / gaps if gaps > 0 else float("nan")
        return Timed(stamps[0] - queued, itl)


async def stream(client: Client, llm: LLM, args: argparse.Namespace, index: int, priority: int,
                 stop: asyncio.Event, record: Background) -> None:  # fmt: skip
    salt = 10_000 * (index + 1)
    while not stop.is_set():
        record.started += 1
        prompt = prompt_of(llm, args.background_tokens, salt + record.started)
        timed = await client.run(prompt, args.background_max_tokens, priority)
        record.waits.append(timed.ttft)
        record.completed += 1


async def mode_run(llm: LLM, args: argparse.Namespace, mode: str) -> dict[str, object]:
    engine = AsyncEngine(llm.engine)
    engine.start()
    try:
        client = Client(engine)
        interactive = [prompt_of(llm, args.interactive_tokens, 7 + i) for i in range(args.requests)]
        solo = [await client.run(p, args.max_tokens, 0) for p in interactive]
        log(f"{mode}: solo done, TTFT p50 {quantile([t.ttft for t in solo], 0.5):.2f} s")
        if mode != "priority":
            interactive = interactive[: args.none_requests]
        background_priority = 10 if mode == "priority" else 0
        stop, record = asyncio.Event(), Background()
        tasks = [
            asyncio.create_task(stream(client, llm, args, i, background_priority, stop, record))
            for i in range(args.streams)
        ]
        await asyncio.sleep(args.warmup_s)  # the streams' prompts in flight
        loaded = []
        for prompt in interactive:
            loaded.append(await client.run(prompt, args.max_tokens, 0))
            log(f"{mode}: interactive {len(loaded)} TTFT {loaded[-1].ttft:.2f} s")
            await asyncio.sleep(args.gap_s)
        stop.set()
        await asyncio.gather(*tasks)  # every background request runs to its end
        log(f"{mode}: background done ({record.completed} requests)")
        return {"solo": solo, "loaded": loaded, "background": record}
    finally:
        engine.stop()


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def report(mode: str, result: dict[str, object]) -> None:
    solo, loaded = result["solo"], result["loaded"]
    background = result["background"]
    assert isinstance(solo, list) and isinstance(loaded, list)
    assert isinstance(background, Background)
    cells = []
    for name in ("ttft", "itl"):
        alone = [getattr(t, name) for t in solo]
        under = [getattr(t, name) for t in loaded]
        for q in (0.5, 0.95):
            base, got = quantile(alone, q), quantile(under, q)
            cells.append(f"{base * 1000:.0f} -> {got * 1000:.0f} ms ({got / base:.2f}x)")
    worst = max(background.waits, default=float("nan"))
    print(
        f"| {mode} | {' | '.join(cells)} | {background.completed}/{background.started} | "
        f"{worst:.1f} s | {statistics.median(background.waits):.1f} s |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--background-tokens", type=int, default=4000)
    parser.add_argument("--background-max-tokens", type=int, default=16)
    parser.add_argument("--interactive-tokens", type=int, default=1000)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--none-requests", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--warmup-s", type=float, default=2.0)
    parser.add_argument("--gap-s", type=float, default=0.2)
    parser.add_argument("--modes", default="priority,none")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    checkpoint = install_default()
    context = args.background_tokens + args.background_max_tokens + 64
    capacity = (args.streams + 2) * context
    rows = []
    for mode in args.modes.split(","):
        llm = LLM(str(checkpoint), dtype="float32", kv_capacity=capacity, max_model_len=context,
                  max_concurrency=args.streams + 2, prefix_cache=False)  # fmt: skip
        started = time.perf_counter()
        result = asyncio.run(mode_run(llm, args, mode))
        rows.append((mode, result, time.perf_counter() - started))
        report(mode, result)
        del llm
    print(
        f"\n{args.streams} background streams of {args.background_tokens}-token prompts; "
        f"{args.requests} interactive requests of {args.interactive_tokens} tokens, "
        f"{args.max_tokens} generated; solo -> loaded\n"
    )
    print("| mode | TTFT p50 | TTFT p95 | ITL p50 | ITL p95 | background done | worst wait | "
          "median wait |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for mode, result, _ in rows:
        report(mode, result)
    print("\n" + ", ".join(f"{mode}: {seconds:.0f} s" for mode, _, seconds in rows))


if __name__ == "__main__":
    main()
