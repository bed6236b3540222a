"""The default model served from its shipped Q4_1 GGUF (weights packed) against its float32
expansion (what `dgpp model install-default` installs), in one run, same threads:

    python bench/gguf_decode.py

Greedy decode of 128 tokens after a short chat prompt (after an 8-token warm-up), a 1,000-token
prefill, and the process's resident set after both; one process per variant. The llama.cpp side
of the issue's comparison is not part of this bench yet (docs/benchmarks.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import psutil

from dgpp.appliance.default_model import ensure_default_gguf, install_default
from dgpp.engine import LLM, SamplingParams


def measure(model: str) -> dict[str, float | str]:
    llm = LLM(model, kv_capacity=2048)
    prompt = llm.render_chat([{"role": "user", "content": "Write a long story about a fox."}])
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    started = time.perf_counter()
    out = llm.generate([prompt], params)[0]
    decode = 128 / (time.perf_counter() - started)
    ids = list(llm.tokenizer(" ".join(["fox"] * 1000)).input_ids)[:1000]
    started = time.perf_counter()
    llm.generate([ids], SamplingParams(temperature=0, max_tokens=1))
    prefill = 1000 / (time.perf_counter() - started)
    rss = psutil.Process().memory_info().rss / 2**20
    return {"decode": decode, "prefill": prefill, "rss": rss, "text": out.outputs[0].text[:60]}


def main() -> None:
    if len(sys.argv) == 2:
        print(json.dumps(measure(sys.argv[1])))
        return
    variants = {"Q4_1 GGUF (packed)": str(ensure_default_gguf()), "float32": str(install_default())}
    rows = {}
    for name, model in variants.items():
        done = subprocess.run(
            [sys.executable, __file__, model], capture_output=True, text=True, check=True
        )
        rows[name] = json.loads(done.stdout.strip().splitlines()[-1])
    print("| weights | decode (tok/s) | prefill 1,000 (tok/s) | RSS (MiB) | first words |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['decode']:.1f} | {r['prefill']:.0f} | {r['rss']:.0f} | {r['text']!r} |"
        )
    base = rows["float32"]
    packed = rows["Q4_1 GGUF (packed)"]
    print(f"decode ratio Q4_1 / float32: {packed['decode'] / base['decode']:.2f}x")


if __name__ == "__main__":
    main()
