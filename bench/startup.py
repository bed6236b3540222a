"""Time to ready: dgpp cold (from the checkpoint) vs warm (from its resident image), and
transformers `from_pretrained` + first token, each as a fresh process on the same checkpoint.

    .venv/bin/python bench/startup.py [--models default,llama-1.5b] [--repeats 2] [--threads 2]
        [--serve-args "--no-native-decode"]

`ready` is process start to `/health` 200; `first token` adds one greedy completion token through
HTTP. The transformers figure is process start to its first generated token. The ~1.5B model is a
random-weight Llama-shaped checkpoint (Qwen2.5-1.5B's shapes, separate q/k/v and gate/up tensors,
bfloat16, 1 GB safetensors shards) written once under ~/.cache/dgpp-bench/.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

BENCH_CACHE = Path.home() / ".cache" / "dgpp-bench"
LLAMA_15B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
}

# The default install is a GGUF file beside its tokenizer: transformers reads it with `gguf_file`.
HF_SCRIPT = """
import os, sys, time, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
torch.set_num_threads(int(sys.argv[2]))
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
gguf = "model.gguf" if os.path.isfile(os.path.join(sys.argv[1], "model.gguf")) else None
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32, gguf_file=gguf)
model.eval()
ids = tokenizer("Hello", return_tensors="pt").input_ids
with torch.inference_mode():
    model.generate(ids, max_new_tokens=1, do_sample=False)
print("first-token", flush=True)
"""


def write_llama_15b(out: Path, tokenizer_from: Path) -> Path:
    """Random weights, written tensor by tensor (never a whole model in memory)."""
    import torch
    from safetensors.torch import save_file

    if (out / "model.safetensors.index.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    c = LLAMA_15B
    hidden, inter, head_dim = c["hidden_size"], c["intermediate_size"], 1536 // 12
    kv = c["num_key_value_heads"] * head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c["vocab_size"], hidden)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (hidden, hidden),
            p + "self_attn.k_proj.weight": (kv, hidden),
            p + "self_attn.v_proj.weight": (kv, hidden),
            p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
    shapes["model.norm.weight"] = (hidden,)
    generator = torch.Generator().manual_seed(0)
    shard: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    shard_names: list[str] = []

    def flush() -> None:
        name = f"model-{len(shard_names) + 1:05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        shard_names.append(name)
        weight_map.update(dict.fromkeys(shard, name))
        shard.clear()

    size = 0
    for name, shape in shapes.items():
        if len(shape) == 1:
            tensor = torch.ones(shape, dtype=torch.bfloat16)
        else:
            tensor = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
        shard[name] = tensor
        size += tensor.numel() * 2
        if size >= 1 << 30:
            flush()
            size = 0
    if shard:
        flush()
    total = sum(2 * torch.Size(s).numel() for s in shapes.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (out / "config.json").write_text(json.dumps(LLAMA_15B, indent=1))
    for item in tokenizer_from.iterdir():
        if item.name.startswith("tokenizer") or item.name.endswith(".jinja"):
            shutil.copy(item, out / item.name)
    return out


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def dgpp_start(
    checkpoint: Path, resident: Path, threads: int, extra: Sequence[str] = ()
) -> tuple[float, float, str]:
    """(ready s, first token s, the ready log line) of one `dgpp serve` process."""
    port = free_port()
    env = {**os.environ, "DGPP_RESIDENT_DIR": str(resident)}
    command = [sys.executable, "-m", "dgpp.appliance.cli", "serve", "--model", str(checkpoint)]
    command += ["--port", str(port), "--kv-capacity", "4096", "--threads", str(threads)]
    command += ["--served-model-name", "m", *extra]
    with tempfile.TemporaryFile() as log:
        started = time.perf_counter()
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            while True:
                if process.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(f"dgpp exited:\n{log.read().decode()[-3000:]}")
                try:
                    if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.02)
            ready = time.perf_counter() - started
            body = {"model": "m", "prompt": "Hello", "max_tokens": 1, "temperature": 0}
            httpx.post(f"{url}/v1/completions", json=body, timeout=120).raise_for_status()
            first = time.perf_counter() - started
        finally:
            process.terminate()
            process.wait(60)
        log.seek(0)
        lines = [line for line in log.read().decode().splitlines() if "ready in" in line]
    return ready, first, lines[-1].split("INFO dgpp.head: ")[-1] if lines else ""


def hf_start(checkpoint: Path, threads: int) -> float:
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", HF_SCRIPT, str(checkpoint), str(threads)],
        check=True,
        capture_output=True,
        env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"},
    )
    return time.perf_counter() - started


def bench(
    name: str, checkpoint: Path, repeats: int, threads: int, extra: Sequence[str] = ()
) -> None:
    print(f"\n## {name}: {checkpoint}")
    colds, warms = [], []
    for _ in range(repeats):
        resident = Path(tempfile.mkdtemp(prefix="dgpp-resident-"))
        try:
            colds.append(dgpp_start(checkpoint, resident, threads, extra))
            warms.append(dgpp_start(checkpoint, resident, threads, extra))
        finally:
            shutil.rmtree(resident, ignore_errors=True)
    cold, warm = min(colds), min(warms)
    hf = min(hf_start(checkpoint, threads) for _ in range(repeats))
    print(f"dgpp cold : ready {cold[0]:6.2f} s, first token {cold[1]:6.2f} s  [{cold[2]}]")
    print(f"dgpp warm : ready {warm[0]:6.2f} s, first token {warm[1]:6.2f} s  [{warm[2]}]")
    print(f"transformers from_pretrained + first token: {hf:6.2f} s")
    print(
        f"warm/cold ready: {warm[0] / cold[0]:.3f}; warm first token / transformers: "
        f"{warm[1] / hf:.3f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="default,llama-1.5b")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--serve-args", default="", help="more `dgpp serve` options, one string")
    args = parser.parse_args()
    from dgpp.appliance.models.default import install_default

    default = install_default()
    for name in args.models.split(","):
        if name == "default":
            checkpoint = default
        elif name == "llama-1.5b":
            checkpoint = write_llama_15b(BENCH_CACHE / "llama-1.5b", default)
        else:
            checkpoint = Path(name)
        bench(name, checkpoint, args.repeats, args.threads, shlex.split(args.serve_args))


if __name__ == "__main__":
    main()
