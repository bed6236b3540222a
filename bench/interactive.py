"""Interactive scheduling: a short request beside a long prefill, the interactive step policy
against first-come-first-served (dgpp's policy before issue 15) in one run.

    python bench/interactive.py [--long 4000,7900] [--short-tokens 8]

The default model (SmolLM2-135M, float32) on this machine's CPU; one engine per policy, driven
step by step as the server's engine thread drives it. For each long prompt length (distinct,
uncached prompts):

(a) TTFT of a one-line chat request alone, and when it arrives while the long prompt is in
    prefill (one step after it);
(b) inter-token latency of a running stream, alone and while the long prompt is prefilled;
(c) the long prompt's own prefill time (to its first token) alone, and with short requests
    arriving every few steps meanwhile (the cost of fairness).

FCFS is the same engine with `short_prompt_tokens=1` (no real prompt is short) and
`step_target_ms=-1` (no step-time bound). See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from typing import Any

from dgpp.appliance.default_model import install_default
from dgpp.engine.llm import LLM
from dgpp.engine.sampling_params import SamplingParams

POLICIES = {
    "interactive": {},
    "fcfs": {"short_prompt_tokens": 1, "step_target_ms": -1.0},
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--long", default="4000,7900", help="long prompt lengths in tokens")
    args = parser.parse_args()
    lengths = [int(n) for n in args.long.split(",")]
    checkpoint = str(install_default())
    rows = []
    for name, knobs in POLICIES.items():
        llm = LLM(checkpoint, kv_capacity=24576, max_model_len=8192, **knobs)
        scenario(llm, 256, 99, "Warm up.")  # first-use costs out of the figures
        for salt, tokens in enumerate(lengths):
            rows.append((name, tokens, scenario(llm, tokens, 10 * salt, "Say hi.")))
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


if __name__ == "__main__":
    main()
