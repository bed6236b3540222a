"""dgpp vs transformers on the default model, side by side in one process, same dtype and threads.

    .venv/bin/python bench/bench_engine.py [--threads 2] [--new-tokens 256] [--repeats 2]

Measures single-stream greedy decode tok/s, prefill time of a ~1,000-token prompt, and aggregate
tok/s with 8 concurrent requests, then prints dgpp/transformers ratios. Best of `--repeats`.
"""

from __future__ import annotations

import os

# Both engines share one OpenMP runtime; let its workers spin briefly between the many small
# kernels of a decode step instead of sleeping (the `dgpp` CLI sets the same default).
os.environ.setdefault("GOMP_SPINCOUNT", "10000000")

import argparse
import time
from collections.abc import Callable

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dgpp.appliance.models.default import install_default
from dgpp.engine import LLM, SamplingParams

STORY = (
    "The lighthouse keeper wrote in her log every evening: the colour of the sea, the ships that "
    "passed, the birds that rested on the rail, and the small repairs the old lamp needed. "
)


def best_of(repeats: int, fn: Callable[[], float]) -> float:
    return min(fn() for _ in range(repeats))


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def hf_decode(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> None:
    """Greedy `generate` for equal-length prompts batched together, exactly `new_tokens` each."""
    batch = torch.tensor(prompts)
    model.generate(
        batch,
        attention_mask=torch.ones_like(batch),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prefill-tokens", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    checkpoint = install_default()
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    hf = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    llm = LLM(str(checkpoint), dtype="float32", num_threads=args.threads, kv_capacity=16384)

    chat = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]
    prompt = llm.render_chat(chat)
    long_ids = tokenizer(STORY * 40).input_ids[: args.prefill_tokens]
    prompts = [prompt] * args.concurrency
    n = args.new_tokens
    decode = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    first_token = SamplingParams(temperature=0.0, max_tokens=1)

    llm.generate([prompt], SamplingParams(max_tokens=4))  # warm-up
    with torch.inference_mode():
        hf_decode(hf, [prompt], 4)
        results = {
            "single-stream decode": (
                n / best_of(args.repeats, lambda: timed(lambda: llm.generate([prompt], decode))),
                n / best_of(args.repeats, lambda: timed(lambda: hf_decode(hf, [prompt], n))),
                "tok/s",
            ),
            f"prefill {len(long_ids)} tokens": (
                best_of(args.repeats, lambda: timed(lambda: llm.generate([long_ids], first_token))),
                best_of(args.repeats, lambda: timed(lambda: hf_decode(hf, [long_ids], 1))),
                "s",
            ),
            f"aggregate, {args.concurrency} concurrent": (
                args.concurrency
                * n
                / best_of(args.repeats, lambda: timed(lambda: llm.generate(prompts, decode))),
                args.concurrency
                * n
                / best_of(args.repeats, lambda: timed(lambda: hf_decode(hf, prompts, n))),
                "tok/s",
            ),
        }
    print(f"threads={args.threads} dtype=float32 torch={torch.__version__}")
    print(f"{'metric':32} {'dgpp':>10} {'transformers':>13} {'dgpp/hf':>8}")
    for name, (ours, theirs, unit) in results.items():
        print(f"{name:32} {ours:10.3f} {theirs:13.3f} {ours / theirs:8.2f}  {unit}")
    single = results["single-stream decode"][0]
    aggregate = results[f"aggregate, {args.concurrency} concurrent"][0]
    print(f"dgpp aggregate / dgpp single-stream = {aggregate / single:.2f}")


if __name__ == "__main__":
    main()
