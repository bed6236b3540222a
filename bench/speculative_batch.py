"""Speculative decoding under concurrency: a mixed batch (copying and free-form requests) served
by dgpp with and without n-gram drafting, in one process; prints throughput, mean request
latency and their ratios.

    python bench/speculative_batch.py [--batch 8] [--max-tokens 128] [--depth 4] [--repeats 2]

Every request generates exactly `--max-tokens` tokens (EOS ignored), so both runs do the same
work; outputs must be identical (exit 1 otherwise). See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from dgpp.appliance.offline import LLM
from dgpp.engine import SamplingParams

SOURCE = (Path(__file__).resolve().parents[1] / "engine" / "block_manager.py").read_text()[:1500]
ORDER = '{"id": 7, "items": [1, 2, 3], "ship": {"to": "Oslo", "by": null}}'
QUESTIONS = (
    "Repeat this code exactly:\n" + SOURCE,
    "Write a poem about the sea.",
    "Repeat this JSON exactly, one object per line:\n" + "\n".join([ORDER] * 4),
    "Explain how TCP works.",
    "Summarise this code:\n" + SOURCE[:800],
    "List ten fruits.",
    "What is the capital of France?",
    "Tell me a story about a dragon.",
)


def _run(
    llm: LLM, prompts: list[str], params: SamplingParams
) -> tuple[float, float, list[list[int]]]:
    """Wall seconds for the batch, mean seconds from arrival to finish per request, tokens."""
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - started
    latencies = [
        o.timings.finished - o.timings.arrival
        for o in outputs
        if o.timings is not None and o.timings.finished is not None
    ]
    return seconds, sum(latencies) / len(latencies), [list(o.outputs[0].token_ids) for o in outputs]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    knobs = {"prefix_cache": False, "num_threads": args.threads}
    engines = {
        "plain": LLM("default", **knobs),
        "ngram": LLM("default", speculative="ngram", spec_depth=args.depth, **knobs),
    }
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.batch)]
    template = engines["plain"].tokenizer.apply_chat_template
    prompts = [
        template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in questions
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    best: dict[str, float] = {}
    latency: dict[str, float] = {}
    tokens: dict[str, list[list[int]]] = {}
    for llm in engines.values():
        llm.generate(prompts[:1], SamplingParams(max_tokens=2))  # warm-up
    for _ in range(args.repeats):
        for name, llm in engines.items():  # interleaved, so drift hits both alike
            seconds, mean, tokens[name] = _run(llm, prompts, params)
            best[name] = min(seconds, best.get(name, seconds))
            latency[name] = min(mean, latency.get(name, mean))
    total = args.batch * args.max_tokens
    spec = engines["ngram"].engine.counters.spec_decode
    rate = spec.accepted_tokens / spec.draft_tokens if spec.draft_tokens else 0.0
    for name in engines:
        print(
            f"{name:6} {best[name]:7.2f} s  {total / best[name]:7.1f} tok/s  "
            f"mean request latency {latency[name]:6.2f} s"
        )
    ratio = best["plain"] / best["ngram"]
    faster = latency["plain"] / latency["ngram"]
    print(
        f"batch {args.batch}: ngram / plain throughput {ratio:.2f}x, mean latency "
        f"{faster:.2f}x shorter, acceptance {rate:.1%}"
    )
    result = {
        "batch": args.batch,
        "throughput_ratio": round(ratio, 3),
        "latency_ratio": round(faster, 3),
        "acceptance": round(rate, 3),
    }
    print(json.dumps({"bench": "speculative_batch", **result}))
    if tokens["plain"] != tokens["ngram"]:
        print("MISMATCH: speculation changed the greedy output", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
