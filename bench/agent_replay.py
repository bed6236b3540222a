"""Replays a coding-agent session against dgpp with the prefix cache on, then off.

    .venv/bin/python bench/agent_replay.py [--turns 12] [--port 18090] [--tiny-hybrid]

Starts `dgpp serve` on the default model (or `--model PATH`; `--tiny-hybrid` builds a random-weight
Qwen3-Next checkpoint, Gated DeltaNet + gated attention + MoE, with the default model's tokenizer
and chat template, so the prefix cache must restore recurrent-state snapshots) twice (cache on,
then `--no-prefix-cache`), replays the
same multi-turn session (a long system prompt with tool instructions, then user turns, tool
calls and tool results, growing past 4,000 tokens) over the OpenAI streaming API, and prints per
turn: prompt tokens, cached tokens, TTFT. Then: the hit rate over reusable prompt tokens (the
tokens each turn shares with the previous turn's prompt plus reply), TTFT(hit) / TTFT(miss) on
the last turn, and the ratio of total replay wall time with and without the cache; for a hybrid
model also the state snapshots the cache held and restored (from /v1/metrics).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

TOOLS_DOC = "\n".join(
    f"- tool `{name}`: {what}. Arguments: a JSON object with `{arg}` (string). Use it whenever "
    f"the task needs it; never invent its output; report errors verbatim to the user."
    for name, what, arg in [
        ("read_file", "returns the text of a file in the repository", "path"),
        ("write_file", "replaces a file's text", "path"),
        ("run_tests", "runs the test suite and returns the failures", "selector"),
        ("grep", "searches the repository for a regular expression", "pattern"),
        ("list_dir", "lists a directory", "path"),
        ("git_diff", "shows the uncommitted changes", "path"),
    ]
)
SYSTEM = (
    "You are a careful coding agent working in a Python repository. Follow the house rules: "
    "small modules, type hints, tests for every change, no secrets in logs. "
    + "You can call these tools:\n"
    + TOOLS_DOC
    + "\n"
) * 4


def file_text(functions: int) -> str:
    """A tool result: the text of a small Python file (about 33 tokens per function)."""
    return "\n".join(
        f"def handler_{i}(request: dict) -> dict:\n"
        f"    return {{'status': {200 + i}, 'id': request['id']}}"
        for i in range(functions)
    )


@dataclass
class Turn:
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    reply: str


def build_tiny_hybrid(out: Path) -> Path:
    """A random-weight Qwen3-Next (8 layers, hidden 512: 6 Gated DeltaNet, 2 gated attention;
    16 experts, top 4, a shared expert) with SmolLM2's tokenizer and chat template."""
    import torch
    import transformers

    tokenizer_dir = Path.home() / ".local/share/dgpp/models/SmolLM2-135M-Instruct"
    config = transformers.Qwen3NextConfig(
        vocab_size=49152,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=256,
        shared_expert_intermediate_size=256,
        max_position_embeddings=16384,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    config.architectures = ["Qwen3NextForCausalLM"]
    torch.manual_seed(0)
    model = transformers.Qwen3NextForCausalLM(config).eval()
    model.save_pretrained(str(out), safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tokenizer_dir / name, out / name)
    return out


def start_server(
    port: int, cache: bool, model: str, extra: tuple[str, ...] = ()
) -> subprocess.Popen[bytes]:
    command = [
        str(Path(sys.executable).with_name("dgpp")),
        "serve",
        "--model",
        model,
        "--port",
        str(port),
        "--log-level",
        "warning",
        *extra,
    ]
    if not cache:
        command.append("--no-prefix-cache")
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    server.kill()
    raise RuntimeError("dgpp serve did not become healthy")


def chat(client: httpx.Client, messages: list[dict], **fields: object) -> Turn:
    """One streamed turn; `fields` go into the body too (a `prompt_cache_key`)."""
    body = {
        **fields,
        "model": client.get("/v1/models").json()["data"][0]["id"],
        "messages": messages,
        "max_tokens": 24,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft = None
    reply = ""
    usage = {}
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                text = choice["delta"].get("content") or ""
                if text and ttft is None:
                    ttft = time.perf_counter() - start
                reply += text
    return Turn(
        usage["prompt_tokens"],
        usage["prompt_tokens_details"]["cached_tokens"],
        ttft if ttft is not None else time.perf_counter() - start,
        reply,
    )


def session_step(messages: list[dict], turn: int, reply: str, functions: int) -> None:
    """Append what the agent and its tools say after `reply`, for the next request."""
    messages.append(
        {
            "role": "assistant",
            "content": reply,
            "tool_calls": [
                {
                    "id": f"call_{turn}",
                    "type": "function",
                    "function": {
                        "name": "read_file",
                        "arguments": json.dumps({"path": f"app/h{turn}.py"}),
                    },
                }
            ],
        }
    )
    messages.append(
        {
            "role": "tool",
            "tool_call_id": f"call_{turn}",
            "content": file_text(functions).replace("handler_", f"h{turn}_"),
        }
    )
    messages.append({"role": "user", "content": f"Step {turn + 1}: now check handler {turn}."})


def replay(
    port: int, turns: int, functions: int
) -> tuple[list[Turn], float, list[int], dict | None]:
    messages: list[dict] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Step 1: fix the failing handler."},
    ]
    results, reusable = [], []
    previous: list[int] = []
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
        start = time.perf_counter()
        for turn in range(turns):
            tokens = client.post("/tokenize", json={"messages": messages}).json()["tokens"]
            shared = 0
            for a, b in zip(tokens, previous, strict=False):
                if a != b:
                    break
                shared += 1
            reusable.append(shared)
            result = chat(client, messages)
            results.append(result)
            reply_ids = client.post(
                "/tokenize", json={"prompt": result.reply, "add_special_tokens": False}
            ).json()
            previous = tokens + reply_ids["tokens"]
            session_step(messages, turn, result.reply, functions)
        wall = time.perf_counter() - start
        metrics = client.get("/v1/metrics").json()
    return results, wall, reusable, metrics["prefix_cache"].get("state_snapshots")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--turns", type=int, default=12)
    parser.add_argument("--port", type=int, default=18090)
    parser.add_argument(
        "--functions",
        type=int,
        default=12,
        help="functions in each tool result: how much each turn adds (~33 tokens each)",
    )
    parser.add_argument("--model", default="default", help="checkpoint to serve")
    parser.add_argument(
        "--tiny-hybrid", action="store_true", help="serve a random-weight tiny Qwen3-Next"
    )
    args = parser.parse_args()
    os.environ.setdefault("GOMP_SPINCOUNT", "10000000")
    model = args.model
    scratch = tempfile.TemporaryDirectory(prefix="dgpp-agent-replay-")
    if args.tiny_hybrid:
        model = str(build_tiny_hybrid(Path(scratch.name) / "tiny-qwen3-next"))
    runs = {}
    for cache in (True, False):
        server = start_server(args.port, cache, model)
        try:
            runs[cache] = replay(args.port, args.turns, args.functions)
        finally:
            server.terminate()
            server.wait(30)
    (hot, hot_wall, reusable, snapshots), (cold, cold_wall, _, _) = runs[True], runs[False]
    print(f"{'turn':>4} {'prompt':>7} {'reusable':>8} {'cached':>7} {'TTFT on':>8} {'TTFT off':>9}")
    for index, (on, off) in enumerate(zip(hot, cold, strict=True)):
        print(
            f"{index + 1:4d} {on.prompt_tokens:7d} {reusable[index]:8d} {on.cached_tokens:7d} "
            f"{on.ttft_s:8.3f} {off.ttft_s:9.3f}"
        )
    hit_rate = sum(t.cached_tokens for t in hot) / max(1, sum(reusable))
    last_on, last_off = hot[-1], cold[-1]
    print(f"hit rate over reusable prompt tokens: {hit_rate:.1%}")
    print(
        f"last turn ({last_on.prompt_tokens} tokens): TTFT hit {last_on.ttft_s:.3f} s, "
        f"miss {last_off.ttft_s:.3f} s, ratio {last_on.ttft_s / last_off.ttft_s:.3f}"
    )
    print(
        f"replay wall time: cache on {hot_wall:.1f} s, off {cold_wall:.1f} s, "
        f"ratio {hot_wall / cold_wall:.2f}"
    )
    if snapshots is not None:
        print(
            f"state snapshots: {snapshots['held']} held ({snapshots['bytes'] / 2**20:.1f} MiB, "
            f"capacity {snapshots['capacity']}), {snapshots['saved']} saved, "
            f"{snapshots['hits']} restored; restores by depth (tokens): "
            f"{snapshots['hits_by_depth_tokens']}"
        )
    scratch.cleanup()


if __name__ == "__main__":
    main()
