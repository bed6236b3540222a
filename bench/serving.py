"""Serving under concurrent load, measured by a third-party load generator: guidellm (pinned,
installed once into its own virtual environment outside the repository) against `dgpp serve`
and llama.cpp's server (llama-cpp-python's, the same build as bench/gguf_decode.py's peer) on
the same GGUF file, one after the other, same threads:

    python bench/serving.py [--seconds 75] [--streams 1,4,8] [--model PATH.gguf]

Text completions of `--prompt-tokens` (256) synthetic prompt tokens and `--output-tokens` (64)
output tokens, `--seconds` at each concurrency; printed side by side: median time to first
token, median inter-token latency and output tokens per second (guidellm's figures, from its
JSON report).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from dgpp.appliance.models.default import install_default
from dgpp.kernels.cache_dir import dgpp_cache_dir

sys.path.insert(0, str(Path(__file__).parent))
from gguf_decode import peer_python
from load import free_port, launch, stop_server

GUIDELLM = "guidellm==0.8.1"
# guidellm depends on torch; the CPU build keeps its environment small (a plain torch is CUDA's)
GUIDELLM_TORCH = "torch==2.13.0"
PEER_SERVER = "llama-cpp-python[server]==0.3.36"


def guidellm() -> Path:
    """guidellm's command, installed on first use."""
    venv = dgpp_cache_dir() / "bench" / "guidellm"
    command = venv / "bin" / "guidellm"
    if command.exists():
        return command
    print(f"installing {GUIDELLM} into {venv} (once)", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, GUIDELLM_TORCH, GUIDELLM], check=True)
    return command


def peer_server_python() -> Path:
    """llama-cpp-python's venv with its server's extra (the build is bench/gguf_decode.py's)."""
    python = peer_python()
    check = [str(python), "-c", "import llama_cpp.server.app, uvicorn"]
    if subprocess.run(check, capture_output=True).returncode != 0:
        subprocess.run([str(python), "-m", "pip", "install", "-q", PEER_SERVER], check=True)
    return python


def load(args: argparse.Namespace, port: int, out: Path) -> list[dict[str, float]]:
    """guidellm at each concurrency of `args.streams`; per level: TTFT and ITL medians (ms) and
    output tokens per second."""
    data = (
        f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}"
    )
    command = [
        str(guidellm()),
        "run",
        "--backend",
        f"kind=openai_http,target=http://127.0.0.1:{port},request_format=/v1/completions,"
        "validate_backend=false",  # its check is GET /health, which llama.cpp's server lacks
        "--profile",
        "kind=concurrent",
        "--override",
        "profile.streams",
        args.streams,
        "--constraint",
        f"kind=max_duration,seconds={args.seconds}",
        "--data",
        data,
        "--tokenizer",
        f"kind=huggingface_auto,model={args.tokenizer}",
        "--output",
        f"kind=json,path={out}",
        "--disable-console-interactive",
    ]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    report = json.loads(out.read_text())
    levels = []
    for benchmark in report["benchmarks"]:
        metrics = benchmark["metrics"]
        levels.append(
            {
                "ttft": metrics["time_to_first_token_ms"]["successful"]["median"],
                "itl": metrics["inter_token_latency_ms"]["successful"]["median"],
                "output": metrics["output_tokens_per_second"]["total"]["mean"],
                "done": metrics["request_totals"]["successful"],
            }
        )
    return levels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=int, default=75)
    parser.add_argument("--streams", default="1,4,8")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--model", type=Path, help="a GGUF file (default: the shipped Q4_1)")
    args = parser.parse_args()
    installed = install_default()
    model = args.model or installed / "model.gguf"
    args.tokenizer = installed  # SmolLM2's tokenizer, as every GGUF of the default model's
    streams = [int(s) for s in args.streams.split(",")]
    max_concurrency = str(max(streams))
    servers = {
        "dgpp": [
            str(Path(sys.executable).with_name("dgpp")),
            "serve",
            "--model",
            str(model),
            "--host",
            "127.0.0.1",
            "--threads",
            str(args.threads),
            "--max-concurrency",
            max_concurrency,
            "--log-level",
            "warning",
        ],
        "llama.cpp": [
            str(peer_server_python()),
            "-m",
            "llama_cpp.server",
            "--model",
            str(model),
            "--host",
            "127.0.0.1",
            "--n_threads",
            str(args.threads),
            "--n_threads_batch",
            str(args.threads),
            "--n_ctx",
            "4096",
        ],
    }
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name, command in servers.items():
            port = free_port()
            log, url = Path(scratch) / f"{name}.log", f"http://127.0.0.1:{port}/v1/models"
            server = launch([*command, "--port", str(port)], url, log, 600)
            try:
                results[name] = load(args, port, Path(scratch) / f"{name}.json")
            finally:
                stop_server(server)
            print(f"{name} done", file=sys.stderr)
    print(
        f"guidellm {GUIDELLM.split('==')[1]}, {model.name}, {args.threads} threads, "
        f"{args.prompt_tokens} prompt / {args.output_tokens} output tokens, "
        f"{args.seconds} s a level"
    )
    print(
        "| concurrent | dgpp TTFT | llama.cpp TTFT | dgpp ITL | llama.cpp ITL | dgpp output | "
        "llama.cpp output | output ratio |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for n, ours, peer in zip(streams, results["dgpp"], results["llama.cpp"], strict=True):
        print(
            f"| {n} | {ours['ttft'] / 1e3:.2f} s | {peer['ttft'] / 1e3:.2f} s"
            f" | {ours['itl']:.1f} ms | {peer['itl']:.1f} ms"
            f" | {ours['output']:.1f} tok/s | {peer['output']:.1f} tok/s"
            f" | {ours['output'] / peer['output']:.2f}x |"
        )
    one, last = results["dgpp"][0], results["dgpp"][-1]
    print(f"dgpp ITL at {streams[-1]} / at {streams[0]}: {last['itl'] / one['itl']:.2f}x")


if __name__ == "__main__":
    main()
