"""llama.cpp's side of bench/perplexity.py, run by the llama-cpp-python venv bench/gguf_decode.py
builds outside the repository (it has no dgpp): the same windows of the same tokens through the
same GGUF file, every position's logits kept (`logits_all`), turned into float32
log-probabilities here.

    <venv>/bin/python bench/llama_cpp_perplexity.py MODEL.gguf THREADS JOB.json OUT.npz

JOB.json: {"tokens": [...], "windows": [[begin, end, first], ...], "top_k": K,
"reference_ids": an .npz with `top_ids` [N - 1, K] or null; optionally "kv_type": the K and
V cache's ggml type by name, "f16", "q8_0" or "q4_0" (`-ctk`/`-ctv`), and "flash_attn": true or
false (a quantized V cache needs it); left out, llama-cpp-python's defaults}. OUT.npz holds per
scored token (row t - 1 for token t): `nll`, `top1`, and `top_ids` / `top_logprobs` (the top K) or
`at_reference` (the log-probabilities of the reference's top K ids). Prints the seconds taken.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import llama_cpp
import numpy as np
from llama_cpp import Llama


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def main() -> None:
    path, threads, job_path, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    job = json.loads(Path(job_path).read_text())
    tokens, spans, top_k = job["tokens"], job["windows"], int(job["top_k"])
    reference = np.load(job["reference_ids"])["top_ids"] if job["reference_ids"] else None
    context = max(end - begin for begin, end, _ in spans)
    options = {"flash_attn": bool(job["flash_attn"])} if "flash_attn" in job else {}
    if "kv_type" in job:
        kv_type = getattr(llama_cpp, f"GGML_TYPE_{job['kv_type'].upper()}")
        options.update(type_k=kv_type, type_v=kv_type)
    llm = Llama(
        model_path=path,
        n_ctx=context,
        n_threads=threads,
        n_threads_batch=threads,
        n_batch=512,
        logits_all=True,
        verbose=False,
        **options,
    )
    n = len(tokens) - 1
    nll, top1 = np.full(n, np.nan, np.float32), np.zeros(n, np.int64)
    top_ids, top_lp = np.zeros((n, top_k), np.int64), np.zeros((n, top_k), np.float32)
    at_reference = np.zeros((n, top_k), np.float32)
    started = time.perf_counter()
    for begin, end, first in spans:
        llm.reset()
        llm.eval(tokens[begin:end])
        rows = np.arange(first - begin - 1, end - begin - 1)  # row j predicts token begin+j+1
        logprobs = log_softmax(np.asarray(llm.scores[rows], dtype=np.float32))
        at = slice(first - 1, end - 1)
        own = np.asarray(tokens[first:end])
        nll[at] = -logprobs[np.arange(len(own)), own]
        top1[at] = logprobs.argmax(axis=-1)
        if reference is None:
            ids = np.argpartition(-logprobs, top_k, axis=-1)[:, :top_k]
            values = np.take_along_axis(logprobs, ids, axis=-1)
            order = np.argsort(-values, axis=-1, kind="stable")
            top_ids[at] = np.take_along_axis(ids, order, axis=-1)
            top_lp[at] = np.take_along_axis(values, order, axis=-1)
        else:
            at_reference[at] = np.take_along_axis(logprobs, reference[at], axis=-1)
    seconds = time.perf_counter() - started
    np.savez(
        out, nll=nll, top1=top1, top_ids=top_ids, top_logprobs=top_lp, at_reference=at_reference
    )
    print(json.dumps({"seconds": seconds}))


if __name__ == "__main__":
    main()
