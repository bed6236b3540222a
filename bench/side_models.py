"""Side models (issue 67), two figures in one run on the default model:

1. Cold on-demand load against `dgpp serve`'s own time to ready: `dgpp serve --model default`
   alone, process start to /health 200; then a deployment whose side model `fast` is the default
   model, loaded on demand: a chat request's arrival to its first streamed byte (the load, then
   the answer's first token). Ratio of the two.
2. A small model beside a saturated main one: the main model (the default model) runs
   `--streams` long streams (2,000-token prompts, 256 tokens each); the side model (the default
   model again) answers short chat requests one after another, their TTFT against the same
   requests with the main model idle (solo), in the same server.

    .venv/bin/python bench/side_models.py [--streams 8] [--requests 10] [--threads 1]

`--threads` is each engine's CPU threads (the main model's and the side model's): on this 2-core
machine one each, as cores are split between two processes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

DGPP = str(Path(sys.executable).with_name("dgpp"))
CHAT = {"messages": [{"role": "user", "content": "Name a prime number."}], "max_tokens": 8}


def wait_healthy(url: str, process: subprocess.Popen[bytes], timeout: float = 300) -> None:
    """Until `url`'s /health answers 200 (dgpp's, llama-server's); raise if `process` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args[0]} exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{process.args[0]} did not become healthy")


def time_to_ready(port: int, threads: int) -> float:
    command = [DGPP, "serve", "--model", "default", "--port", str(port), "--threads",
               str(threads), "--log-level", "warning"]  # fmt: skip
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", process)
        return time.perf_counter() - started
    finally:
        process.terminate()
        process.wait(60)


def first_byte(url: str, model: str, max_tokens: int = 8) -> float:
    """Seconds from sending a streamed chat request to its first content token."""
    body = {**CHAT, "model": model, "stream": True, "max_tokens": max_tokens}
    started = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: ") and '"content": "' in line and '"content": ""' not in line:
                return time.perf_counter() - started
    raise RuntimeError("no token came back")


def saturate(url: str, stop: threading.Event, number: int) -> None:
    text = " ".join(f"word{(number * 7 + i) % 1000}" for i in range(1000))
    body = {"model": "main", "prompt": text, "max_tokens": 256, "ignore_eos": True}
    while not stop.is_set():
        try:
            httpx.post(f"{url}/v1/completions", json=body, timeout=900)
        except httpx.HTTPError:  # the server stopping at the end
            return


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--port", type=int, default=18095)
    args = parser.parse_args()
    ready = time_to_ready(args.port, args.threads)
    engine = {"num_threads": args.threads, "kv_capacity": 24576}
    deployment = {
        "model": "default", "engine": engine,
        "http": {"port": args.port, "served_model_names": ["main"]},
        "side_models": [{"name": "fast", "model": "default", "idle_unload_s": 0,
                         "engine": {"num_threads": args.threads, "kv_capacity": 4096}}],
    }  # fmt: skip
    url = f"http://127.0.0.1:{args.port}"
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "d.json"
        path.write_text(json.dumps(deployment))
        command = [DGPP, "serve", "--deployment", str(path), "--log-level", "warning"]
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        stop = threading.Event()
        try:
            wait_healthy(url, process)
            cold = first_byte(url, "fast")
            solo = [first_byte(url, "fast") for _ in range(args.requests)]
            streams = [threading.Thread(target=saturate, args=(url, stop, n), daemon=True)
                       for n in range(args.streams)]  # fmt: skip
            for stream in streams:
                stream.start()
            time.sleep(20)  # the streams' prefills under way, decode rows running
            loaded = [first_byte(url, "fast") for _ in range(args.requests)]
            main_ttft = first_byte(url, "main")
            stop.set()
        finally:
            stop.set()
            process.terminate()  # the streams in flight make a graceful stop slow: not waited
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    print(
        f"\nthe default model, {args.threads} thread(s) per engine, {args.streams} main streams\n"
    )
    print("| figure | dgpp | ratio |")
    print("|---|---|---|")
    print(f"| `dgpp serve` time to ready | {ready:.2f} s | |")
    print(f"| cold side model: request to first token | {cold:.2f} s | {cold / ready:.2f}x |")
    s50, l50 = statistics.median(solo), statistics.median(loaded)
    s_max, l_max = max(solo), max(loaded)
    print(f"| side model TTFT p50, main idle -> saturated | {s50 * 1000:.0f} -> "
          f"{l50 * 1000:.0f} ms | {l50 / s50:.2f}x |")  # fmt: skip
    print(f"| side model TTFT max, main idle -> saturated | {s_max * 1000:.0f} -> "
          f"{l_max * 1000:.0f} ms | {l_max / s_max:.2f}x |")  # fmt: skip
    print(f"| main model TTFT while saturated (for scale) | {main_ttft * 1000:.0f} ms | |")


if __name__ == "__main__":
    main()
