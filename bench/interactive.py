"""Interactive scheduling: a short request beside a long prefill, the interactive step policy
against first-come-first-served (dgpp's policy before issue 15) in one run.

    python bench/interactive.py [--long 4000,7900] [--cases classic,arrival,trickle]
        [--policies interactive,fcfs] [--offsets 0.1,0.3,0.5,0.7,0.9,3] [--period 2]

The default model (SmolLM2-135M, float32) on this machine's CPU; one engine per policy, driven
step by step as the server's engine thread drives it. For each long prompt length (distinct,
uncached prompts):

(a) TTFT of a one-line chat request alone, and when it arrives while the long prompt is in
    prefill (one step after it);
(b) inter-token latency of a running stream, alone and while the long prompt is prefilled;
(c) the long prompt's own prefill time (to its first token) alone, and with short requests
    arriving every few steps meanwhile (the cost of fairness).

(d) the short request's TTFT when it arrives at several offsets into the long prefill, and
(e) the long prompt's time under a steady trickle of short requests, run through the server's
    engine thread (bench/interactive_arrivals.py), so arrivals land in the middle of steps.

FCFS is the same engine with `short_prompt_tokens=1` (no real prompt is short) and
`step_target_ms=-1` (no step-time bound); `hold-0` and `hold-always` are the interactive policy
with long-only steps never bounded and always bounded (`arrival_hold_ms`, for models whose
chunks are not sliced), and `unsliced` the interactive policy with long chunks bounded by
tokens only, not in layer slices (`dgpp.engine.scheduling.layer_slices`), for choosing the rule. See
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import statistics
import time
from typing import Any

import interactive_arrivals as arrivals

from dgpp.appliance.models.default import install_default
from dgpp.engine.llm import LLM
from dgpp.engine.sampling.sampling_params import SamplingParams

POLICIES = {
    "interactive": {},
    "fcfs": {"short_prompt_tokens": 1, "step_target_ms": -1.0},
    "hold-0": {"arrival_hold_ms": 0.0},
    "hold-always": {"arrival_hold_ms": 1e9},
    "unsliced": {},  # the interactive policy with chunks bounded by tokens only (no layer slices)
}
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven"]


def _long_prompt(llm: LLM, tokens: int, salt: int) -> list[int]:
    text = " ".join(
        WORDS[(i * 7 + salt) % len(WORDS)] + str((i + salt) % 97) for i in range(tokens)
    )
    return list(llm.tokenizer(text).input_ids[:tokens])


def _chat(llm: LLM, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    rendered = llm.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    return list(llm.tokenizer(rendered, add_special_tokens=False).input_ids)


class Driver:
    """Steps an engine; records when each request produced its tokens."""

    def __init__(self, llm: LLM) -> None:
        self.engine = llm.engine
        self.token_times: dict[str, list[float]] = {}
        self.added: dict[str, float] = {}
        self.count = 0

    def add(self, prompt: list[int], max_tokens: int) -> str:
        self.count += 1
        request_id = f"r{self.count}"
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        self.engine.add_request(prompt, params, request_id, use_prefix_cache=False)
        self.added[request_id] = time.perf_counter()
        self.token_times[request_id] = []
        return request_id

    def step(self) -> None:
        for output in self.engine.step():
            if output.num_new_tokens:
                self.token_times[output.request_id].extend(
                    [time.perf_counter()] * output.num_new_tokens
                )

    def run(self, until: Any) -> None:
        while self.engine.has_unfinished() and not until():
            self.step()

    def ttft(self, request_id: str) -> float:
        return self.token_times[request_id][0] - self.added[request_id]

    def itl(self, request_id: str, since: float = 0.0, before: float = float("inf")) -> float:
        times = [t for t in self.token_times[request_id] if since <= t <= before]
        gaps = [b - a for a, b in itertools.pairwise(times)]
        return statistics.median(gaps) if gaps else float("nan")


def scenario(llm: LLM, long_tokens: int, salt: int, short_text: str) -> dict[str, float]:
    driver = Driver(llm)
    short_prompt = _chat(llm, short_text)
    # (a) a short request alone, then beside a long prefill
    alone = driver.add(short_prompt, 4)
    driver.run(lambda: False)
    driver.add(_long_prompt(llm, long_tokens, salt), 2)
    driver.step()
    beside = driver.add(short_prompt, 4)
    driver.run(lambda: len(driver.token_times[beside]) > 0)
    driver.run(lambda: False)
    result = {"ttft_alone": driver.ttft(alone), "ttft_beside": driver.ttft(beside)}
    # (b) a running stream, then a long prompt arriving while it decodes
    stream = driver.add(short_prompt, 400)
    driver.run(lambda: len(driver.token_times[stream]) >= 20)
    arrived = time.perf_counter()
    second_long = driver.add(_long_prompt(llm, long_tokens, salt + 1), 1)
    driver.run(lambda: len(driver.token_times[second_long]) > 0)
    done = time.perf_counter()
    driver.engine.abort(stream)
    driver.run(lambda: False)
    result["itl_alone"] = driver.itl(stream, before=arrived)
    result["itl_during"] = driver.itl(stream, since=arrived, before=done)
    # (c) the long prefill's own time, alone and with short requests arriving meanwhile
    solo = driver.add(_long_prompt(llm, long_tokens, salt + 2), 1)
    driver.run(lambda: False)
    result["long_alone"] = driver.ttft(solo)
    busy = driver.add(_long_prompt(llm, long_tokens, salt + 3), 1)
    steps = 0
    while driver.engine.has_unfinished() and not driver.token_times[busy]:
        if steps % 4 == 0:
            driver.add(short_prompt, 8)
        driver.step()
        steps += 1
    driver.run(lambda: False)
    result["long_with_shorts"] = driver.ttft(busy)
    return result


def classic_table(rows: list[tuple[str, int, dict[str, float]]]) -> None:
    print(
        "| policy | long prompt | short TTFT alone (s) | beside the prefill (s) | ratio | "
        "ITL alone (ms) | during (ms) | ratio | long prefill alone (s) | with shorts (s) | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, tokens, r in rows:
        print(
            f"| {name} | {tokens} | {r['ttft_alone']:.2f} | {r['ttft_beside']:.2f} | "
            f"{r['ttft_beside'] / r['ttft_alone']:.1f}x | {r['itl_alone'] * 1e3:.0f} | "
            f"{r['itl_during'] * 1e3:.0f} | {r['itl_during'] / r['itl_alone']:.1f}x | "
            f"{r['long_alone']:.1f} | {r['long_with_shorts']:.1f} | "
            f"{r['long_with_shorts'] / r['long_alone']:.2f} |"
        )


def arrival_table(rows: list[tuple[str, int, dict[str, float]]], offsets: list[float]) -> None:
    head = " | ".join(f"at {o:g} s" for o in offsets)
    print(f"| policy | long prompt | short TTFT alone (s) | {head} | worst ratio |")
    print("|---|---|---|" + "---|" * len(offsets) + "---|")
    for name, tokens, r in rows:
        cells = " | ".join(f"{r[f'{o:g}']:.2f} ({r[f'{o:g}'] / r['alone']:.1f}x)" for o in offsets)
        worst = max(r[f"{o:g}"] for o in offsets) / r["alone"]
        print(f"| {name} | {tokens} | {r['alone']:.2f} | {cells} | {worst:.1f}x |")


def trickle_table(rows: list[tuple[str, int, dict[str, float]]], period: float) -> None:
    print(
        f"| policy | long prompt | long alone (s) | under a short every {period:g} s (s) | ratio | "
        "short requests | their TTFT median (s) | max (s) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, tokens, r in rows:
        print(
            f"| {name} | {tokens} | {r['long_alone']:.1f} | {r['long_trickle']:.1f} | "
            f"{r['long_trickle'] / r['long_alone']:.2f} | {r['shorts']:.0f} | "
            f"{r['short_median']:.2f} | {r['short_max']:.2f} |"
        )


def _cases(
    llm: LLM, tokens: int, salt: int, cases: set[str], offsets: list[float], period: float
) -> list[tuple[str, dict[str, float]]]:
    """The chosen cases for one long prompt length, on one engine."""
    short = _chat(llm, "Say hi.")
    results = []
    if "classic" in cases:
        results.append(("classic", scenario(llm, tokens, 10 * salt, "Say hi.")))

    def long_prompt(extra: int) -> list[int]:
        return _long_prompt(llm, tokens, 10 * salt + extra)

    if "arrival" in cases:
        job = functools.partial(arrivals.offsets, long_prompt=long_prompt, short=short)
        results.append(("arrival", arrivals.run(lambda a: job(a, offsets_s=offsets), llm)))
    if "trickle" in cases:
        job = functools.partial(arrivals.trickle, long_prompt=long_prompt, short=short)
        with arrivals.Predictions(llm) as predictions:
            results.append(("trickle", arrivals.run(lambda a: job(a, period_s=period), llm)))
        print(f"Step-time model during the trickle ({tokens}-token prompt):")
        print("\n".join(predictions.table()))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--long", default="4000,7900", help="long prompt lengths in tokens")
    parser.add_argument("--cases", default="classic,arrival,trickle")
    parser.add_argument("--policies", default="interactive,fcfs", help=", ".join(POLICIES))
    parser.add_argument("--offsets", default="0.1,0.3,0.5,0.7,0.9,3", help="seconds (d)")
    parser.add_argument("--period", type=float, default=2.0, help="seconds between shorts (e)")
    args = parser.parse_args()
    lengths = [int(n) for n in args.long.split(",")]
    cases = set(args.cases.split(","))
    offsets = [float(o) for o in args.offsets.split(",")]
    checkpoint = str(install_default())
    tables: dict[str, list[tuple[str, int, dict[str, float]]]] = {c: [] for c in cases}
    for name in args.policies.split(","):
        llm = LLM(checkpoint, kv_capacity=24576, max_model_len=8192, **POLICIES[name])
        if name == "unsliced":
            scheduler = llm.engine.scheduler
            scheduler.policy = dataclasses.replace(scheduler.policy, num_layers=0)
        scenario(llm, 256, 99, "Warm up.")  # first-use costs out of the figures
        for salt, tokens in enumerate(lengths):
            for case, result in _cases(llm, tokens, salt, cases, offsets, args.period):
                tables[case].append((name, tokens, result))
    if "classic" in cases:
        classic_table(tables["classic"])
    if "arrival" in cases:
        arrival_table(tables["arrival"], offsets)
    if "trickle" in cases:
        trickle_table(tables["trickle"], args.period)


if __name__ == "__main__":
    main()
