"""Agent sessions against anonymous batch traffic (issue 66): six coding-agent sessions taking
turns, a batch job's prompts between them, over a KV pool a third of the sessions' context; the
prefix cache ordered by sessions (each session's `prompt_cache_key`) against block LRU (the same
requests without one), in one run.

    .venv/bin/python bench/agent_sessions.py [--sessions 6] [--turns 5] [--kv-capacity 4096]
        [--host-gib 0.8] [--batch 2] [--batch-tokens 1500]

Starts `dgpp serve` on the default model twice (sessions, then LRU) with `--kv-capacity` and a host
tier of `--host-gib`: the device pool plus the host tier must hold the sessions (not the batch
traffic as well). Six sessions taking turns round-robin over tiers smaller than their context
defeat any recency order, this one and LRU alike (measured: 1.6% and 0.0% with 3,072 tokens of pool
and 0.3 GiB of host tier against 11,784 tokens of sessions). The sessions are built as
bench/agent_replay.py builds one (a long system prompt with tool instructions, then turns of tool
calls and results), each with its own opening; round by round each session takes a turn, and after
each session's turn `--batch` anonymous prompts of `--batch-tokens` distinct tokens go through.
Prints, per mode, the share of each returning turn's reusable prefix (what it shares with its
session's previous prompt and reply) that came from some tier, the worst turn's share, and the
median TTFT of returning turns.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import httpx
from agent_replay import SYSTEM, chat, session_step, start_server
from agent_tiers import _shared

WORDS = ["alpha", "beta", "gamma", "delta", "kappa", "sigma", "omega", "theta", "lambda"]


def batch_text(tokens: int, salt: int) -> str:
    return " ".join(
        f"{WORDS[(i + salt) % len(WORDS)]}{(i * 7 + salt) % 997}" for i in range(tokens // 2)
    )


def run(args: argparse.Namespace, sessions_on: bool) -> dict[str, object]:
    extra = ("--kv-capacity", str(args.kv_capacity), "--prefix-min-tokens", "0")
    extra += (
        "--prefix-cache-host-gib",
        str(args.host_gib),
        "--max-model-len",
        str(args.kv_capacity),
    )
    server = start_server(args.port, True, "default", extra)
    messages = {
        n: [
            {"role": "system", "content": f"You maintain service {n}.\n{SYSTEM}"},
            {"role": "user", "content": "Step 1: fix the failing handler."},
        ]
        for n in range(args.sessions)
    }
    previous: dict[int, list[int]] = {n: [] for n in messages}
    shares, ttfts, salt = [], [], 0
    started = time.perf_counter()
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{args.port}", timeout=900) as client:
            model = client.get("/v1/models").json()["data"][0]["id"]
            for turn in range(args.turns):
                for n, history in messages.items():
                    tokens = client.post("/tokenize", json={"messages": history}).json()["tokens"]
                    reusable = _shared(tokens, previous[n])
                    key = {"prompt_cache_key": f"agent-{n}"} if sessions_on else {}
                    result = chat(client, history, **key)
                    if turn:
                        shares.append(min(result.cached_tokens, reusable) / max(reusable, 1))
                        ttfts.append(result.ttft_s)
                    reply = client.post(
                        "/tokenize", json={"prompt": result.reply, "add_special_tokens": False}
                    ).json()["tokens"]
                    previous[n] = tokens + reply
                    session_step(history, turn, result.reply, args.functions)
                    for _ in range(args.batch):  # the batch job's prompts, anonymous
                        salt += 1
                        body = {"model": model, "prompt": batch_text(args.batch_tokens, salt),
                                "max_tokens": 1}  # fmt: skip
                        client.post("/v1/completions", json=body).raise_for_status()
            context = sum(len(p) for p in previous.values())
    finally:
        server.terminate()
        server.wait(60)
    return {
        "shares": shares,
        "ttfts": ttfts,
        "context": context,
        "wall": time.perf_counter() - started,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=6)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--port", type=int, default=18092)
    parser.add_argument("--kv-capacity", type=int, default=4096, help="the device pool, tokens")
    parser.add_argument("--host-gib", type=float, default=0.8, help="the host tier")
    parser.add_argument("--batch", type=int, default=2, help="anonymous prompts per turn")
    parser.add_argument("--batch-tokens", type=int, default=1500)
    parser.add_argument("--functions", type=int, default=8, help="~33 tokens each per turn")
    args = parser.parse_args()
    os.environ.setdefault("GOMP_SPINCOUNT", "10000000")
    results = {mode: run(args, mode == "sessions") for mode in ("sessions", "block LRU")}
    context = results["sessions"]["context"]
    print(
        f"\n{args.sessions} sessions x {args.turns} turns, {context} tokens of session context at "
        f"the end ({context / args.kv_capacity:.1f}x the {args.kv_capacity}-token pool), host "
        f"tier {args.host_gib} GiB, {args.batch} anonymous prompts of {args.batch_tokens} tokens "
        "after every turn\n"
    )
    print("| cache order | returning prefix from a tier (mean) | worst turn | median TTFT | wall |")
    print("|---|---|---|---|---|")
    for mode, result in results.items():
        shares, ttfts = result["shares"], result["ttfts"]
        assert isinstance(shares, list) and isinstance(ttfts, list)
        print(
            f"| {mode} | {statistics.mean(shares):.1%} | {min(shares):.1%} | "
            f"{statistics.median(ttfts):.3f} s | {result['wall']:.0f} s |"
        )


if __name__ == "__main__":
    main()
