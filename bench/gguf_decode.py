"""The default model at Q4_1 — dgpp serving its shipped GGUF packed (what `dgpp model
install-default` installs) and llama.cpp serving the same file — and dgpp on its float32
expansion, in one run, same threads:

    python bench/gguf_decode.py

Greedy decode of 128 tokens after the same chat prompt (token ids, after an 8-token warm-up), a
1,000-token prefill, and the process's resident set after both; one process per variant.
llama.cpp is llama-cpp-python 0.3.36, built from source once (about 7 minutes on 2 cores) into a
virtual environment outside the repository, `~/.cache/dgpp/bench/llama-cpp`; the bench says when
it builds it. Both sides use `torch.get_num_threads()` threads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch

from dgpp.appliance.default_model import ensure_default_gguf, install_default
from dgpp.engine import LLM, SamplingParams
from dgpp.kernels.cache_dir import dgpp_cache_dir

PEER_VERSION = "llama-cpp-python==0.3.36"
PROMPT = [{"role": "user", "content": "Write a long story about a fox."}]


def peer_python() -> Path:
    """The llama-cpp-python venv's interpreter, built on first use."""
    venv = dgpp_cache_dir() / "bench" / "llama-cpp"
    python = venv / "bin" / "python"
    check = [str(python), "-c", "import llama_cpp"]
    if python.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return python
    print(f"building {PEER_VERSION} into {venv} (once, about 7 minutes)", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {**os.environ, "CMAKE_ARGS": os.environ.get("CMAKE_ARGS", peer_cmake_args())}
    command = [str(python), "-m", "pip", "install", "-q", "--no-cache-dir", PEER_VERSION]
    subprocess.run(command, check=True, env=env)
    return python


def peer_cmake_args() -> str:
    """llama.cpp's build for this CPU without AMX: its native build compiles AMX tile code where
    the compiler knows AMX, which died with SIGILL on a VM whose kernel does not grant AMX state
    (2026-12-06); dgpp's kernels use AVX-512 and no AMX, so the peer gets the same ISA."""
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    wanted = {"avx": "AVX", "avx2": "AVX2", "fma": "FMA", "f16c": "F16C", "avx512f": "AVX512"}
    on = [f"-DGGML_{name}=ON" for flag, name in wanted.items() if flag in flags]
    return " ".join(["-DGGML_NATIVE=OFF", *on]) if on else ""


def inputs(model: str) -> tuple[list[int], list[int]]:
    llm = LLM(model, kv_capacity=64)
    prompt = list(llm.render_chat(PROMPT))
    prefill = list(llm.tokenizer(" ".join(["fox"] * 1000)).input_ids)[:1000]
    return prompt, prefill


def measure(model: str, prompt: list[int], prefill: list[int]) -> dict[str, float | str]:
    llm = LLM(model, kv_capacity=2048)
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    started = time.perf_counter()
    out = llm.generate([prompt], params)[0]
    decode = 128 / (time.perf_counter() - started)
    started = time.perf_counter()
    llm.generate([prefill], SamplingParams(temperature=0, max_tokens=1))
    rate = len(prefill) / (time.perf_counter() - started)
    rss = psutil.Process().memory_info().rss / 2**20
    return {"decode": decode, "prefill": rate, "rss": rss, "text": out.outputs[0].text[:60]}


def float32_expansion() -> Path:
    from dgpp.appliance.default_model import _write_float32

    target = dgpp_cache_dir() / "bench" / "SmolLM2-135M-Instruct-float32"
    if not (target / "config.json").is_file():
        target.mkdir(parents=True, exist_ok=True)
        _write_float32(ensure_default_gguf(), target)
    return target


def main() -> None:
    if len(sys.argv) == 4:
        print(json.dumps(measure(sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]))))
        return
    gguf = install_default()  # the Q4_1 install: its model.gguf is the shipped file
    prompt, prefill = inputs(str(gguf))
    threads = torch.get_num_threads()
    args = [json.dumps(prompt), json.dumps(prefill)]
    here = Path(__file__).parent
    commands = {
        "dgpp Q4_1 (packed)": [sys.executable, __file__, str(gguf), *args],
        "llama.cpp Q4_1": [
            str(peer_python()),
            str(here / "llama_cpp_peer.py"),
            str(gguf / "model.gguf"),
            str(threads),
            *args,
        ],
        "dgpp float32": [sys.executable, __file__, str(float32_expansion()), *args],
    }
    rows = {}
    for name, command in commands.items():
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        rows[name] = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"{threads} threads, {len(prompt)}-token prompt")
    print("| engine, weights | decode (tok/s) | prefill 1,000 (tok/s) | RSS (MiB) | first words |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['decode']:.1f} | {r['prefill']:.0f} | {r['rss']:.0f} | {r['text']!r} |"
        )
    ours, peer = rows["dgpp Q4_1 (packed)"], rows["llama.cpp Q4_1"]
    print(
        f"dgpp / llama.cpp at Q4_1: decode {ours['decode'] / peer['decode']:.2f}x, prefill "
        f"{ours['prefill'] / peer['prefill']:.2f}x, RSS {ours['rss'] - peer['rss']:+.0f} MiB"
    )


if __name__ == "__main__":
    main()
