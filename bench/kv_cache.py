"""KV-cache dtypes on this CPU (issue 65), each against `auto` in one run, the default model
(SmolLM2-135M, Q4_1 served packed, float32 activations):

(a) decode ms/token at 1K, 8K and 32K tokens of context, with the KV bytes a decode step reads
    (every layer's keys and values of the context) and the ratio to `auto`'s time. The default
    model's positions end at 8,192: for 32K the same weights run under a copy of its config
    with 32,768 positions (speed only; its tokens there mean nothing).
(b) greedy output of 16 chat prompts (64 new tokens) at each dtype against `auto`: per prompt
    the first position where the tokens differ (- where none does).

`auto` and `int8` run the fused native decode step (it reads float32 and int8 caches in place);
`fp8_e4m3` and `int4` the PyTorch layer path, so (a) also shows what `auto` costs on that path
(`auto/layers`).

    python bench/kv_cache.py [--contexts 1024,8192,32768] [--dtypes int8,fp8_e4m3,int4]
                             [--layers-upto 8192] [--skip a|b]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from dgpp.appliance.models.default import install_default
from dgpp.engine.llm import LLM
from dgpp.engine.sampling.sampling_params import SamplingParams

NEW_TOKENS = 32
PROMPTS = [
    "Write a haiku about the sea.",
    "What is the capital of France?",
    "Explain photosynthesis in two sentences.",
    "List three prime numbers greater than 50.",
    "Translate 'good morning' into Spanish.",
    "Give me a recipe for pancakes.",
    "Why is the sky blue?",
    "Summarize the plot of Hamlet.",
    "What does a compiler do?",
    "Name the planets of the solar system.",
    "How do I reverse a list in Python?",
    "What is the boiling point of water in Fahrenheit?",
    "Describe a cat to someone who has never seen one.",
    "What are the benefits of exercise?",
    "Write a limerick about a programmer.",
    "Who wrote Pride and Prejudice?",
]


def long_positions(default: Path, positions: int) -> Path:
    """A folder with the default model's files and its config at `positions` positions."""
    folder = Path(tempfile.mkdtemp(prefix="kv-bench-"))
    for item in default.iterdir():
        if item.name != "config.json":
            (folder / item.name).symlink_to(item)
    config = json.loads((default / "config.json").read_text())
    config["max_position_embeddings"] = positions
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def engine(model: Path, kv: str, context: int, native: bool = True) -> LLM:
    return LLM(
        str(model), kv_capacity=context + 256, max_model_len=context + 128,
        kv_cache_dtype=kv, native_decode=native, prefix_cache=False, prefill_chunk_tokens=2048,
    )  # fmt: skip


def decode_ms(llm: LLM, context: int) -> float:
    """ms per decoded token after a `context`-token prompt (the prompt's prefill excluded)."""
    prompt = [(7 * i) % 40000 + 100 for i in range(context)]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    engine = llm.engine
    engine.add_request(prompt, params)
    while engine.scheduler.requests and not any(
        r.num_output_tokens for r in engine.scheduler.requests.values()
    ):
        engine.step()  # the prefill, to the first token
    started = time.perf_counter()
    print(f"decode from {time.strftime('%H:%M:%S')}", file=sys.stderr, flush=True)
    while engine.has_unfinished():
        engine.step()
    print(f"decode to {time.strftime('%H:%M:%S')}", file=sys.stderr, flush=True)
    return (time.perf_counter() - started) / (NEW_TOKENS - 1) * 1e3


def kv_bytes_per_token(llm: LLM) -> int:
    """Every layer's key and value bytes of one token (pools [layers, 2, blocks, block, ...])."""
    pools = llm.engine.runner.kv_caches
    return sum(p.numel() * p.element_size() // (p.shape[2] * p.shape[3]) for p in pools)


def speed(default: Path, contexts: list[int], dtypes: list[str], layers_upto: int) -> list[dict]:
    rows = []
    for context in contexts:
        model = default if context + 128 <= 8192 else long_positions(default, 32768 + 1024)
        found = {}
        layers = [("auto/layers", False)] if context <= layers_upto else []
        for kv, native in [("auto", True), *layers, *[(d, True) for d in dtypes]]:
            llm = engine(model, kv.split("/")[0], context, native)
            found[kv] = (decode_ms(llm, context), kv_bytes_per_token(llm))
            del llm
        base = found["auto"][0]
        for kv, (ms, per_token) in found.items():
            rows.append({
                "context": context, "kv": kv, "ms_per_token": ms, "speed_vs_auto": base / ms,
                "kv_bytes_read_per_step": per_token * context,
            })  # fmt: skip
        if model is not default:
            shutil.rmtree(model)
    return rows


def greedy(default: Path, dtypes: list[str]) -> dict[str, list[int | None]]:
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    outputs = {}
    for kv in ["auto", *dtypes]:
        llm = engine(default, kv, 2048, native=False)  # one path for all: only the cache differs
        chats = [[{"role": "user", "content": text}] for text in PROMPTS]
        outs = llm.chat(chats, params)
        outputs[kv] = [list(out.outputs[0].token_ids) for out in outs]
    first_diff = {}
    for kv in dtypes:
        first_diff[kv] = [
            next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), None)
            for x, y in zip(outputs["auto"], outputs[kv], strict=True)
        ]
    return first_diff


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", default="1024,8192,32768")
    parser.add_argument("--dtypes", default="int8,fp8_e4m3,int4")
    parser.add_argument("--skip", default="", help="a or b")
    parser.add_argument(
        "--layers-upto", type=int, default=8192,
        help="run auto/layers at contexts up to this (a 32K prefill takes minutes an engine)",
    )  # fmt: skip
    args = parser.parse_args()
    default = install_default()
    dtypes = args.dtypes.split(",")
    if "a" not in args.skip:
        print("| context | KV dtype | ms/token | speed vs auto | KV MB read per step |")
        print("|---|---|---|---|---|")
        contexts = [int(c) for c in args.contexts.split(",")]
        for row in speed(default, contexts, dtypes, args.layers_upto):
            print(
                f"| {row['context']:,} | {row['kv']} | {row['ms_per_token']:.1f} | "
                f"{row['speed_vs_auto']:.2f}x | {row['kv_bytes_read_per_step'] / 1e6:.1f} |"
            )
    if "b" not in args.skip:
        print("\n| KV dtype | prompts equal to auto | first differing position per prompt |")
        print("|---|---|---|")
        for kv, positions in greedy(default, dtypes).items():
            same = sum(p is None for p in positions)
            shown = ", ".join("-" if p is None else str(p) for p in positions)
            print(f"| {kv} | {same} of {len(positions)} | {shown} |")


if __name__ == "__main__":
    main()
