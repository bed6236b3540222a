"""Speculative decoding by n-gram lookup: dgpp with and without it, side by side with transformers
greedy `generate` and its prompt-lookup decoding; one process, same dtype, threads and prompt ids.

    .venv/bin/python bench/speculative.py [--threads N] [--max-tokens 192] [--depth 4]
        [--repeats 2] [--workloads edit,quote,open] [--json results.json]

Workloads (chat-templated, greedy): `edit` returns a 68-line Python file with one small change
(an agent's edit: the answer should copy the context), `quote` repeats a JSON document with one
field changed, `open` answers a free-form question (little to copy: the cost of drafts that
miss). Each configuration is loaded once and warmed up; the best of `--repeats` is reported.
`decode tok/s` leaves out the time to the first token (the prefill, which speculation does not
touch); the ratios are of it.
Exits non-zero if dgpp's output with speculation differs from its output without.
"""

from __future__ import annotations

import os

# Both engines share one OpenMP runtime; let its workers spin briefly between the many small
# kernels of a decode step instead of sleeping (the `dgpp` CLI sets the same default).
os.environ.setdefault("GOMP_SPINCOUNT", "10000000")

import argparse
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from itertools import zip_longest
from typing import Any

import torch
from transformers import AutoModelForCausalLM
from transformers.generation.streamers import BaseStreamer
from transformers.utils import logging as hf_logging

from dgpp.appliance.models.store import resolve_model
from dgpp.appliance.offline import LLM
from dgpp.engine import SamplingParams

SOURCE = '''"""Fetch JSON documents over HTTP with retries and a small in-memory cache."""

from __future__ import annotations

import json
import time
import urllib.request
from dataclasses import dataclass, field


@dataclass
class CacheEntry:
    value: dict
    expires_at: float


@dataclass
class Fetcher:
    base_url: str
    timeout: float = 10.0
    max_retries: int = 3
    backoff: float = 0.5
    ttl: float = 60.0
    cache: dict[str, CacheEntry] = field(default_factory=dict)

    def url_for(self, path: str) -> str:
        return self.base_url.rstrip("/") + "/" + path.lstrip("/")

    def cached(self, path: str) -> dict | None:
        entry = self.cache.get(path)
        if entry is None or entry.expires_at < time.monotonic():
            return None
        return entry.value

    def store(self, path: str, value: dict) -> None:
        self.cache[path] = CacheEntry(value, time.monotonic() + self.ttl)

    def fetch(self, path: str) -> dict:
        hit = self.cached(path)
        if hit is not None:
            return hit
        last_error: Exception | None = None
        for attempt in range(self.max_retries):
            try:
                with urllib.request.urlopen(self.url_for(path), timeout=self.timeout) as reply:
                    value = json.loads(reply.read().decode("utf-8"))
                self.store(path, value)
                return value
            except OSError as error:
                last_error = error
                time.sleep(self.backoff * 2**attempt)
        raise RuntimeError(f"giving up on {path}: {last_error}")

    def fetch_many(self, paths: list[str]) -> dict[str, dict]:
        return {path: self.fetch(path) for path in paths}

    def clear(self) -> None:
        self.cache.clear()


def main() -> None:
    fetcher = Fetcher("https://example.com/api")
    for name, value in fetcher.fetch_many(["users/1", "users/2"]).items():
        print(name, value.get("name"))


if __name__ == "__main__":
    main()
'''

DOCUMENT = {
    "order_id": "A-10482",
    "status": "pending",
    "customer": {"name": "Maria Lopez", "email": "maria.lopez@example.com", "tier": "gold"},
    "shipping": {"street": "221 Harbour Road", "city": "Portsmouth", "postcode": "PO1 3AX"},
    "items": [
        {"sku": "KB-204", "name": "Mechanical keyboard", "quantity": 1, "unit_price": 89.5},
        {"sku": "MS-118", "name": "Wireless mouse", "quantity": 2, "unit_price": 24.99},
        {"sku": "CB-007", "name": "USB-C cable, 2 m", "quantity": 3, "unit_price": 7.25},
    ],
    "notes": "Leave the parcel with the neighbour at number 223 if nobody answers.",
}

WORKLOADS: dict[str, str] = {
    "edit": "Here is a Python file:\n\n```python\n"
    + SOURCE
    + "```\n\nChange the default `max_retries` from 3 to 5. Return the complete updated file in "
    "one Python code block and nothing else.",
    "quote": "Here is a JSON document:\n\n"
    + json.dumps(DOCUMENT, indent=2)
    + '\n\nRepeat this document verbatim, with "status" changed to "shipped". Output only the '
    "JSON.",
    "open": "Why do cities grow near rivers and coasts? Explain the history and the economics in "
    "a few paragraphs.",
}

CONFIGS = ("dgpp", "dgpp-ngram", "hf", "hf-lookup")


@dataclass
class Run:
    tokens: list[int]
    seconds: float  # the whole generate call
    ttft: float  # to the first generated token

    @property
    def decode_tok_s(self) -> float:
        return (len(self.tokens) - 1) / max(self.seconds - self.ttft, 1e-9)


@dataclass
class Spec:
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    decode_steps: int = 0
    accepted_per_position: list[int] = field(default_factory=list)


class FirstToken(BaseStreamer):
    """Notes when `generate` streams its first new token (the first `put` is the prompt)."""

    def __init__(self) -> None:
        self.puts = 0
        self.first: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def spec_counts(llm: LLM) -> list[int]:
    counters = llm.engine.counters
    spec = counters.spec_decode
    head = [spec.drafts, spec.draft_tokens, spec.accepted_tokens, counters.num_decode_steps]
    return head + list(spec.accepted_per_position)


def spec_delta(before: list[int], after: list[int]) -> Spec:
    delta = [a - b for a, b in zip_longest(after, before, fillvalue=0)]
    return Spec(*delta[:4], accepted_per_position=delta[4:])


def run_dgpp(llm: LLM, ids: list[int], params: SamplingParams) -> Run:
    start = time.perf_counter()
    (output,) = llm.generate([ids], params)
    seconds = time.perf_counter() - start
    timings = output.timings
    assert timings is not None and timings.first_token is not None
    return Run(list(output.outputs[0].token_ids), seconds, timings.first_token - timings.arrival)


def run_hf(model: Any, ids: list[int], args: argparse.Namespace, lookup: bool) -> Run:
    options: dict[str, Any] = {"max_new_tokens": args.max_tokens, "do_sample": False}
    if args.ignore_eos:
        options["min_new_tokens"] = args.max_tokens
    if lookup:
        options["prompt_lookup_num_tokens"] = args.depth
        options["max_matching_ngram_size"] = args.ngram_max
    batch = torch.tensor([ids])
    streamer = FirstToken()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            batch,
            attention_mask=torch.ones_like(batch),
            pad_token_id=model.generation_config.eos_token_id,
            streamer=streamer,
            **options,
        )
    seconds = time.perf_counter() - start
    first = streamer.first if streamer.first is not None else start + seconds
    return Run(out[0, len(ids) :].tolist(), seconds, first - start)


def common_prefix(a: list[int], b: list[int]) -> int:
    differ = (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    return next(differ, min(len(a), len(b)))


def revision() -> str:
    def git(*command: str) -> str:
        return subprocess.run(["git", *command], capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    return commit + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--depth", type=int, default=4, help="draft tokens per step (both)")
    parser.add_argument("--ngram-max", type=int, default=4)
    parser.add_argument("--ngram-min", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--ignore-eos", action="store_true", help="always max-tokens tokens")
    parser.add_argument("--json", metavar="PATH", help="also write the results here")
    args = parser.parse_args()
    names = [name.strip() for name in args.workloads.split(",") if name.strip()]
    unknown = sorted(set(names) - set(WORKLOADS))
    if unknown:
        parser.error(f"unknown workload(s) {unknown}; known: {', '.join(WORKLOADS)}")

    torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()
    checkpoint = resolve_model(args.model)
    # No prefix cache: every repeat computes its prompt, as transformers does.
    knobs: dict[str, Any] = {"dtype": "float32", "num_threads": args.threads, "kv_capacity": 4096}
    knobs["prefix_cache"] = False
    plain = LLM(str(checkpoint), **knobs)
    ngram = LLM(
        str(checkpoint),
        speculative="ngram",
        spec_depth=args.depth,
        spec_ngram_max=args.ngram_max,
        spec_ngram_min=args.ngram_min,
        **knobs,
    )
    hf = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    prompts = {
        name: plain.render_chat([{"role": "user", "content": WORKLOADS[name]}]) for name in names
    }
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)

    warm = prompts[names[0]]
    warm_params = SamplingParams(temperature=0.0, max_tokens=32)  # drafts of every length
    for llm in (plain, ngram):
        llm.generate([warm], warm_params)
    hf_warm = argparse.Namespace(**{**vars(args), "max_tokens": 8, "ignore_eos": False})
    run_hf(hf, warm, hf_warm, lookup=False)
    run_hf(hf, warm, hf_warm, lookup=True)

    results: dict[str, dict[str, Any]] = {}
    mismatches: list[str] = []
    for name in names:
        ids = prompts[name]
        runs: dict[str, list[Run]] = {config: [] for config in CONFIGS}
        spec = Spec()
        for _ in range(args.repeats):  # interleaved, so that noise spreads over every config
            runs["dgpp"].append(run_dgpp(plain, ids, params))
            before = spec_counts(ngram)
            runs["dgpp-ngram"].append(run_dgpp(ngram, ids, params))
            spec = spec_delta(before, spec_counts(ngram))
            runs["hf"].append(run_hf(hf, ids, args, lookup=False))
            runs["hf-lookup"].append(run_hf(hf, ids, args, lookup=True))
        reference = runs["dgpp"][0].tokens
        for config in ("dgpp", "dgpp-ngram"):
            for run in runs[config]:
                if run.tokens != reference:
                    at = common_prefix(run.tokens, reference)
                    mismatches.append(f"{name}: {config} differs from dgpp at token {at}")
        best = {config: min(runs[config], key=lambda r: r.seconds) for config in CONFIGS}
        results[name] = summarize(ids, best, spec)

    print_tables(args, results)
    record = {"bench": "speculative", "revision": revision(), "torch": torch.__version__}
    record |= {key: value for key, value in vars(args).items() if key != "json"}
    record |= {"results": results, "identical": not mismatches}
    line = json.dumps(record, separators=(",", ":"))
    print(line)
    if args.json:
        with open(args.json, "w") as handle:
            handle.write(line + "\n")
    if mismatches:
        lines = ["MISMATCH: speculation changed dgpp's greedy output", *mismatches]
        sys.exit("\n".join(["!" * 78, *lines, "!" * 78]))


def summarize(ids: list[int], best: dict[str, Run], spec: Spec) -> dict[str, Any]:
    configs = {
        config: {
            "tokens": len(run.tokens),
            "seconds": round(run.seconds, 3),
            "tok_s": round(len(run.tokens) / run.seconds, 2),
            "ttft_s": round(run.ttft, 3),
            "decode_tok_s": round(run.decode_tok_s, 2),
        }
        for config, run in best.items()
    }

    def ratio(a: str, b: str, key: str = "decode_tok_s") -> float:
        return round(configs[a][key] / configs[b][key], 3)

    generated = configs["dgpp-ngram"]["tokens"]
    return {
        "prompt_tokens": len(ids),
        "configs": configs,
        "ratios": {
            "ngram/plain": ratio("dgpp-ngram", "dgpp"),
            "ngram/hf-lookup": ratio("dgpp-ngram", "hf-lookup"),
            "hf-lookup/hf": ratio("hf-lookup", "hf"),
            "ngram/plain_e2e": ratio("dgpp-ngram", "dgpp", "tok_s"),
            "ngram/hf-lookup_e2e": ratio("dgpp-ngram", "hf-lookup", "tok_s"),
        },
        "spec": {
            **asdict(spec),
            "acceptance_rate": round(spec.accepted_tokens / max(spec.draft_tokens, 1), 3),
            "mean_accepted_per_draft": round(spec.accepted_tokens / max(spec.drafts, 1), 3),
            "tokens_per_decode_step": round((generated - 1) / max(spec.decode_steps, 1), 3),
        },
        "agreement": {
            "dgpp_vs_hf_prefix": common_prefix(best["dgpp"].tokens, best["hf"].tokens),
            "hf_lookup_vs_hf_prefix": common_prefix(best["hf-lookup"].tokens, best["hf"].tokens),
        },
    }


def print_tables(args: argparse.Namespace, results: dict[str, dict[str, Any]]) -> None:
    print(
        f"threads={args.threads} dtype=float32 torch={torch.__version__} "
        f"max_tokens={args.max_tokens} depth={args.depth} "
        f"ngram={args.ngram_min}..{args.ngram_max} repeats={args.repeats} (best of)"
    )
    print()
    header = f"{'workload':9} {'config':11} {'tokens':>6} {'seconds':>8} {'tok/s':>7} "
    print(header + f"{'ttft s':>7} {'decode tok/s':>12}")
    for name, result in results.items():
        for config, row in result["configs"].items():
            print(
                f"{name:9} {config:11} {row['tokens']:6d} {row['seconds']:8.2f} "
                f"{row['tok_s']:7.2f} {row['ttft_s']:7.3f} {row['decode_tok_s']:12.2f}"
            )
    print()
    print(
        f"{'workload':9} {'prompt':>6} {'ngram/plain':>11} {'ngram/hf-lookup':>15} "
        f"{'hf-lookup/hf':>12} {'accept':>7} {'acc/draft':>9} {'tok/step':>8} "
        f"{'dgpp=hf':>8}"
    )
    for name, result in results.items():
        ratios, spec, agreement = result["ratios"], result["spec"], result["agreement"]
        tokens = result["configs"]["dgpp"]["tokens"]
        print(
            f"{name:9} {result['prompt_tokens']:6d} {ratios['ngram/plain']:10.2f}x "
            f"{ratios['ngram/hf-lookup']:14.2f}x {ratios['hf-lookup/hf']:11.2f}x "
            f"{spec['acceptance_rate']:7.1%} {spec['mean_accepted_per_draft']:9.2f} "
            f"{spec['tokens_per_decode_step']:8.2f} "
            f"{agreement['dgpp_vs_hf_prefix']:>4}/{tokens:<3}"
        )
    print()
    print(
        "ratios are of decode tok/s (prefill left out); accept = accepted / drafted tokens; "
        "acc/draft = accepted tokens per draft; tok/step = generated tokens per decode forward; "
        "dgpp=hf = leading tokens where dgpp and transformers greedy agree"
    )


if __name__ == "__main__":
    main()
