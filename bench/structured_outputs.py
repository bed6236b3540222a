"""Structured outputs: what a grammar costs per token, and llguidance beside xgrammar.

    python bench/structured_outputs.py [--requests 8] [--repeats 3]

1. Libraries (the default model's tokenizer, 49,152 tokens): grammar compile time and the mean
   and worst time to fill one token mask while a valid document of a nested JSON schema is
   consumed token by token, for llguidance (dgpp's) and xgrammar (when installed:
   `pip install xgrammar==0.2.9` in a scratch environment; it pulls triton).
2. Engine (the default model, float32): a batch of `--requests` sampled requests under the
   schema, then the same requests without it, each forced to the same number of tokens
   (`ignore_eos`, `max_tokens` = what the constrained one produced), `--repeats` times
   alternating: wall time per generated token for both and their median ratio, and the time
   spent masking (the step's `mask_rows`, timed) per generated token. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "tags", "address", "color"],
    "additionalProperties": False,
}
DOCUMENT = json.dumps(
    {
        "name": "Ada Lovelace",
        "age": 36,
        "tags": ["math", "poetry", "engines"],
        "address": {"city": "London", "zip": "12345"},
        "color": "green",
    }
)


def _llguidance(tokenizer: Any, vocab: int, ids: list[int]) -> tuple[float, list[float]]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    from dgpp.engine.sampling.grammar import JSON_OPTIONS

    lltokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    start = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(SCHEMA), defaults=JSON_OPTIONS
    )
    matcher = llguidance.LLMatcher(lltokenizer, grammar)
    compile_s = time.perf_counter() - start
    mask = llguidance.torch.allocate_token_bitmask(1, vocab)
    times = []
    for token in ids:
        begin = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(matcher, mask, 0)
        times.append(time.perf_counter() - begin)
        assert matcher.consume_token(token), matcher.get_error()
    return compile_s, times


def _xgrammar(tokenizer: Any, vocab: int, ids: list[int]) -> tuple[float, list[float]] | None:
    try:
        import xgrammar
    except ImportError:
        return None
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiler = xgrammar.GrammarCompiler(info)
    start = time.perf_counter()
    matcher = xgrammar.GrammarMatcher(
        compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    )
    compile_s = time.perf_counter() - start
    mask = xgrammar.allocate_token_bitmask(1, vocab)
    times = []
    for token in ids:
        begin = time.perf_counter()
        matcher.fill_next_token_bitmask(mask, 0)
        times.append(time.perf_counter() - begin)
        assert matcher.accept_token(token)
    return compile_s, times


def libraries(repeats: int) -> None:
    from dgpp.appliance.models.default import install_default
    from dgpp.engine.tokenization.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(install_default())
    vocab = 49152
    ids = tokenizer(DOCUMENT, add_special_tokens=False).input_ids
    print(f"libraries: {len(ids)} tokens of a nested schema's document, best of {repeats}")
    print("| library | compile (ms) | mask mean (us) | mask worst (us) |")
    print("|---|---|---|---|")
    results = {}
    for name, run in (("llguidance", _llguidance), ("xgrammar", _xgrammar)):
        best = None
        for _ in range(repeats):
            got = run(tokenizer, vocab, ids)
            if got is None:
                break
            if best is None or statistics.mean(got[1]) < statistics.mean(best[1]):
                best = got
        if best is None:
            print(f"| {name} | not installed | | |")
            continue
        compile_s, times = best
        results[name] = (compile_s, statistics.mean(times))
        print(
            f"| {name} | {compile_s * 1e3:.1f} | {statistics.mean(times) * 1e6:.0f} "
            f"| {max(times) * 1e6:.0f} |"
        )
    if len(results) == 2:
        (lc, lm), (xc, xm) = results["llguidance"], results["xgrammar"]
        print(f"xgrammar/llguidance: compile {xc / lc:.1f}x, mask {xm / lm:.2f}x")


def engine(requests: int, repeats: int) -> None:
    import dgpp.engine.scheduling.step_sampling as step_sampling
    from dgpp.appliance.models.default import install_default
    from dgpp.engine.llm import LLM
    from dgpp.engine.sampling.grammar import json_schema_grammar
    from dgpp.engine.sampling.sampling_params import SamplingParams

    masking = [0.0]
    mask_rows = step_sampling.mask_rows

    def timed_mask_rows(logits: Any, matchers: list[Any]) -> None:
        start = time.perf_counter()
        mask_rows(logits, matchers)
        masking[0] += time.perf_counter() - start

    step_sampling.mask_rows = timed_mask_rows  # what the grammar adds to each step
    llm = LLM(str(install_default()), kv_capacity=8192)
    messages = [{"role": "user", "content": "Describe a person as JSON."}]
    prompt = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    grammar = json_schema_grammar(SCHEMA, "schema")
    llm.generate([prompt], SamplingParams(max_tokens=8, grammar=grammar))  # warm both paths
    ratios, with_times, without_times, tokens = [], [], [], 0
    masking[0] = 0.0
    for repeat in range(repeats):  # alternate, so drift of a shared machine hits both
        constrained = [
            SamplingParams(max_tokens=200, seed=100 * repeat + i, grammar=grammar)
            for i in range(requests)
        ]
        start = time.perf_counter()
        outs = llm.generate([prompt] * requests, constrained)
        with_grammar = time.perf_counter() - start
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        free = [
            SamplingParams(max_tokens=n, seed=i, ignore_eos=True) for i, n in enumerate(lengths)
        ]
        start = time.perf_counter()
        llm.generate([prompt] * requests, free)
        without = time.perf_counter() - start
        count = sum(lengths)
        tokens += count
        with_times.append(with_grammar / count)
        without_times.append(without / count)
        ratios.append(with_grammar / without)
    print(f"engine: {repeats} x {requests} sampled requests, {tokens} tokens, CPU float32")
    print(
        f"per generated token: with the grammar {statistics.median(with_times) * 1e3:.2f} ms, "
        f"without {statistics.median(without_times) * 1e3:.2f} ms (median ratio "
        f"{statistics.median(ratios):.2f}); masking itself "
        f"{masking[0] / tokens * 1e3:.3f} ms per generated token"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    libraries(args.repeats)
    engine(args.requests, args.repeats)


if __name__ == "__main__":
    main()
