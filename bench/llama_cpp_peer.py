"""llama.cpp's side of bench/gguf_decode.py, run by the llama-cpp-python venv the bench builds
outside the repository (it has no dgpp): the same measurements on the same GGUF file.

    <venv>/bin/python bench/llama_cpp_peer.py MODEL.gguf THREADS PROMPT_IDS_JSON PREFILL_IDS_JSON
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
from llama_cpp import Llama


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def last_logits(llm: Llama) -> np.ndarray:
    """The logits of the last token evaluated (the only row llama.cpp keeps without
    logits_all); read in place, no copy of the whole score table."""
    return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))


def greedy(llm: Llama, count: int) -> list[int]:
    tokens = []
    for _ in range(count):
        token = int(last_logits(llm).argmax())  # greedy, past EOS like dgpp
        tokens.append(token)
        llm.eval([token])
    return tokens


def main() -> None:
    path, threads = sys.argv[1], int(sys.argv[2])
    prompt, prefill = json.loads(sys.argv[3]), json.loads(sys.argv[4])
    llm = Llama(
        model_path=path,
        n_ctx=2048,
        n_threads=threads,
        n_threads_batch=threads,
        n_batch=512,
        logits_all=False,
        verbose=False,
    )
    llm.eval(prompt)
    greedy(llm, 8)  # warm-up, as dgpp's side
    llm.reset()
    llm.eval(prompt)
    started = time.perf_counter()
    tokens = greedy(llm, 128)
    decode = 128 / (time.perf_counter() - started)
    text = llm.detokenize(tokens).decode(errors="replace")
    llm.reset()
    started = time.perf_counter()
    llm.eval(prefill)
    prefill_rate = len(prefill) / (time.perf_counter() - started)
    print(
        json.dumps({"decode": decode, "prefill": prefill_rate, "rss": rss_mib(), "text": text[:60]})
    )


if __name__ == "__main__":
    main()
