"""The default model side by side with llama.cpp on the same GGUF file, in each format: the
shipped Q4_1 (what `dgpp model install-default` installs, served packed) and Q8_0, F16 and F32
files written from it (bench/gguf_variants.py); same threads, one process per measurement, dgpp
and llama.cpp alternating, the median of `--rounds` (3) runs of each:

    python bench/gguf_decode.py [--rounds N] [--formats Q4_1,Q8_0,F16,F32] [--threads N]

Measured: greedy decode of 128 tokens after the same chat prompt (token ids, after an 8-token
warm-up; the rate of the tokens after the first, the prompt's prefill left out on both sides), a
1,000-token prefill, dgpp's aggregate decode of 8 concurrent requests (64 tokens each, the same
way; and end to end, their eight 38-token prefills included; llama-cpp-python decodes one
sequence at a time, so its single stream is its aggregate),
and the resident set after all of them; dgpp also reports where its decode step's time went at
batch 1 and 8 (the native step's per-phase clock, `phase_seconds`). llama.cpp is
llama-cpp-python 0.3.36, built from source once (about 7 minutes on 2 cores) into a virtual
environment outside the repository, `~/.cache/dgpp/bench/llama-cpp`; the bench says when it
builds it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch

from dgpp.appliance.models.default import install_default
from dgpp.engine import LLM, SamplingParams
from dgpp.kernels.cache_dir import dgpp_cache_dir

sys.path.insert(0, str(Path(__file__).parent))
from gguf_variants import variant

PEER_VERSION = "llama-cpp-python==0.3.36"
PROMPT = [{"role": "user", "content": "Write a long story about a fox."}]
PHASES = ("q/k/v", "rotary+store", "attention", "o", "gate/up", "down")


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


def _profile(llm: LLM, steps: int) -> list[float] | None:
    """Milliseconds per step in each phase of the native step since the last call."""
    native = llm.engine.runner.native
    if native is None:
        return None
    return [seconds / steps * 1e3 for seconds in native.step.phase_seconds()]


def decode_rate(outs: list) -> float:
    """Tokens per second after each request's first token, the prompt's prefill left out (as
    the peer's timing starts after its prompt is evaluated): every token but the first, over the
    time from the last first token to the last finish."""
    first = max(out.timings.first_token for out in outs)
    finished = max(out.timings.finished for out in outs)
    tokens = sum(len(out.outputs[0].token_ids) - 1 for out in outs)
    return tokens / (finished - first)


def measure(model: str, prompt: list[int], prefill: list[int]) -> dict[str, object]:
    llm = LLM(model, kv_capacity=2048)
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    _profile(llm, 1)
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    out = llm.generate([prompt], params)[0]
    decode = decode_rate([out])
    profile_1 = _profile(llm, 127)
    batch = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    started = time.perf_counter()
    outs = llm.generate([prompt] * 8, batch)
    end_to_end = 8 * 64 / (time.perf_counter() - started)
    aggregate = decode_rate(outs)
    profile_8 = _profile(llm, 63)
    started = time.perf_counter()
    llm.generate([prefill], SamplingParams(temperature=0, max_tokens=1))
    rate = len(prefill) / (time.perf_counter() - started)
    rss = psutil.Process().memory_info().rss / 2**20
    return {
        "decode": decode,
        "prefill": rate,
        "aggregate": aggregate,
        "end_to_end": end_to_end,
        "rss": rss,
        "text": out.outputs[0].text[:60],
        "profile": [profile_1, profile_8],
        "native": llm.engine.runner.native is not None,
    }


def run(command: list[str]) -> dict:
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def median(runs: list[dict], key: str) -> float:
    return statistics.median(float(r[key]) for r in runs)


def main() -> None:
    if len(sys.argv) == 4 and not sys.argv[1].startswith("-"):
        torch.set_num_threads(int(os.environ.get("DGPP_BENCH_THREADS", torch.get_num_threads())))
        print(json.dumps(measure(sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]))))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--formats", default="Q4_1,Q8_0,F16,F32")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    shipped = install_default() / "model.gguf"  # the Q4_1 install: the shipped file
    files = {
        fmt: shipped if fmt == "Q4_1" else variant(shipped, fmt) for fmt in args.formats.split(",")
    }
    prompt, prefill = inputs(str(shipped))
    ids = [json.dumps(prompt), json.dumps(prefill)]
    env_threads = {**os.environ, "DGPP_BENCH_THREADS": str(args.threads)}
    os.environ.update(env_threads)
    peer = [str(peer_python()), str(Path(__file__).with_name("llama_cpp_peer.py"))]
    results: dict[str, dict[str, list[dict]]] = {
        fmt: {"dgpp": [], "llama.cpp": []} for fmt in files
    }
    for round_ in range(args.rounds):
        for fmt, path in files.items():
            results[fmt]["dgpp"].append(run([sys.executable, __file__, str(path), *ids]))
            results[fmt]["llama.cpp"].append(run([*peer, str(path), str(args.threads), *ids]))
            print(f"round {round_ + 1} {fmt} done", file=sys.stderr)
    report(results, args, len(prompt))


def report(results: dict, args: argparse.Namespace, prompt_tokens: int) -> None:
    print(f"{args.threads} threads, {prompt_tokens}-token prompt, median of {args.rounds} runs")
    print(
        "| file | dgpp decode | llama.cpp decode | ratio | dgpp prefill 1,000 | llama.cpp "
        "prefill | ratio | dgpp 8 concurrent | / dgpp single | / llama.cpp | 8 end to end | "
        "dgpp RSS | llama.cpp RSS |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for fmt, sides in results.items():
        ours, peer = sides["dgpp"], sides["llama.cpp"]
        decode, peer_decode = median(ours, "decode"), median(peer, "decode")
        prefill, peer_prefill = median(ours, "prefill"), median(peer, "prefill")
        aggregate = median(ours, "aggregate")
        print(
            f"| {fmt} | {decode:.1f} tok/s | {peer_decode:.1f} tok/s"
            f" | **{decode / peer_decode:.2f}x**"
            f" | {prefill:.0f} tok/s | {peer_prefill:.0f} tok/s | {prefill / peer_prefill:.2f}x"
            f" | {aggregate:.1f} tok/s | {aggregate / decode:.2f}x | {aggregate / peer_decode:.2f}x"
            f" | {median(ours, 'end_to_end'):.1f} tok/s"
            f" | {median(ours, 'rss'):.0f} MiB | {median(peer, 'rss'):.0f} MiB |"
        )
    print("\nfirst words (last run): ")
    for fmt, sides in results.items():
        print(
            f"- {fmt}: dgpp {sides['dgpp'][-1]['text']!r}; "
            f"llama.cpp {sides['llama.cpp'][-1]['text']!r}"
        )
    print(
        "\ndgpp's native decode step, ms per step by phase (median over runs; batch 1 / batch 8):"
    )
    print("| file | " + " | ".join(PHASES) + " |")
    print("|---|" + "---|" * len(PHASES))
    for fmt, sides in results.items():
        profiles = [r["profile"] for r in sides["dgpp"] if r["native"]]
        if not profiles:
            print(f"| {fmt} | (the PyTorch layer path) |")
            continue
        cells = []
        for phase in range(len(PHASES)):
            one = statistics.median(p[0][phase] for p in profiles)
            eight = statistics.median(p[1][phase] for p in profiles)
            cells.append(f"{one:.2f} / {eight:.2f}")
        print(f"| {fmt} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
