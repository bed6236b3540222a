"""dgpp against llama.cpp's own `llama-server --embeddings` on one BERT embedding GGUF (issue 67):
a tiny random BertModel written as llama.cpp's converter writes it (tests/engine/models/
encoder_build.py `write_bert_gguf`: its names, its "▁" WordPiece vocabulary, F16 weights,
`bert.pooling_type`), both servers given the same texts; prints each text's largest difference
and cosine between the two embeddings, for mean and CLS pooling.

    .venv/bin/python bench/bert_gguf_llama_cpp.py [--llama-server PATH]
    .venv/bin/python bench/bert_gguf_llama_cpp.py --write-minilm FILE   (for bench/embeddings.py)

llama-server: the one bench/embeddings.py builds (~/.cache/dgpp/bench), unless given."""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dgpp.engine import LLM
from tests.engine.models.encoder_build import tiny_encoder, wordpiece_tokenizer, write_bert_gguf

TEXTS = ["what is the python function for a file", "Code, code!", "the cache of a model server"]
PORT = 18931


def llama_server() -> Path:
    found = sorted(
        Path.home().glob(".cache/dgpp/bench/llama-server-src/*/llama.cpp/build/bin/llama-server")
    )
    if not found:
        raise SystemExit(
            "no llama-server: build it with bench/embeddings.py, or pass --llama-server"
        )
    return found[-1]


def theirs(server: Path, gguf: Path) -> list[list[float]]:
    command = [str(server), "-m", str(gguf), "--embeddings", "--port", str(PORT), "-t", "2",
               "-c", "64", "-b", "64", "-ub", "64"]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(300):
            try:
                if httpx.get(f"http://127.0.0.1:{PORT}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        body = httpx.post(
            f"http://127.0.0.1:{PORT}/v1/embeddings", json={"input": TEXTS}, timeout=60
        )
        return [item["embedding"] for item in body.json()["data"]]
    finally:
        process.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-server", type=Path, default=None)
    parser.add_argument(
        "--write-minilm", type=Path, default=None, metavar="FILE",
        help="write a random BERT GGUF of all-MiniLM-L6-v2's shape, mean-pooled",
    )  # fmt: skip
    args = parser.parse_args()
    if args.write_minilm is not None:
        with tempfile.TemporaryDirectory() as tmp:
            shape = {"hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 12,
                     "intermediate_size": 1536, "max_position_embeddings": 512}  # fmt: skip
            model = tiny_encoder(Path(tmp), "BertModel", seed=11, **shape)
            write_bert_gguf(model, wordpiece_tokenizer(Path(tmp)), args.write_minilm, 1)
        print(f"wrote {args.write_minilm}")
        return
    server = args.llama_server or llama_server()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = tiny_encoder(work / "hf", "BertModel", seed=9)
        vocab = wordpiece_tokenizer(work / "hf")
        print("| pooling | text | max abs difference | cosine |\n|---|---|---|---|")
        for pooling, name in ((1, "mean"), (2, "CLS")):
            gguf = write_bert_gguf(model, vocab, work / f"bert-{pooling}.gguf", pooling)
            ours = LLM(str(gguf), kind="embed", dtype="float32").embed(TEXTS)
            for text, a, b in zip(TEXTS, ours, theirs(server, gguf), strict=True):
                a, b = torch.tensor(a), torch.tensor(b)
                cosine = torch.nn.functional.cosine_similarity(a, b, dim=0)
                print(f"| {name} | {text} | {(a - b).abs().max():.2e} | {cosine:.6f} |")


if __name__ == "__main__":
    main()
