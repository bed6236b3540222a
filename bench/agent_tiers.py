"""Two coding-agent sessions alternating over a KV pool that holds about one of them: the
prefix cache with the device pool alone, then with the host tier (`prefix_cache_host_gib`).

    .venv/bin/python bench/agent_tiers.py [--turns 6] [--kv-capacity 4096] [--host-gib 1]

Starts `dgpp serve` on the default model with `--kv-capacity` twice (host tier off, then on)
and replays two sessions built as bench/agent_replay.py builds one (a long system prompt with
tool instructions, then user turns, tool calls and tool results), each with its own opening
line, turn by turn alternately (A1 B1 A2 B2 ...) over the OpenAI streaming API. Each session
grows past half the pool, so with the pool alone each turn finds the other session's blocks
where its own were. Prints per turn the prompt, the tokens it shares with its session's
previous prompt and reply (reusable), the cached tokens and TTFT in both runs, then the hit rate
over reusable tokens and the TTFT ratio of each run's turns after the first round.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import httpx
from agent_replay import SYSTEM, Turn, chat, session_step, start_server

OPENING = {"A": "You maintain the billing service.", "B": "You maintain the search service."}


def _shared(tokens: list[int], previous: list[int]) -> int:
    shared = 0
    for a, b in zip(tokens, previous, strict=False):
        if a != b:
            break
        shared += 1
    return shared


def replay(port: int, turns: int, functions: int) -> tuple[list[tuple[str, Turn, int]], dict]:
    """Both sessions, alternately: (session, turn, reusable tokens) per request, and the
    server's prefix-cache metrics at the end."""
    sessions = {
        name: [
            {"role": "system", "content": f"{opening}\n{SYSTEM}"},
            {"role": "user", "content": "Step 1: fix the failing handler."},
        ]
        for name, opening in OPENING.items()
    }
    previous: dict[str, list[int]] = {name: [] for name in sessions}
    results = []
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
        for turn in range(turns):
            for name, messages in sessions.items():
                tokens = client.post("/tokenize", json={"messages": messages}).json()["tokens"]
                reusable = _shared(tokens, previous[name])
                result = chat(client, messages)
                results.append((name, result, reusable))
                reply = client.post(
                    "/tokenize", json={"prompt": result.reply, "add_special_tokens": False}
                ).json()["tokens"]
                previous[name] = tokens + reply
                session_step(messages, turn, result.reply, functions)
        metrics = client.get("/v1/metrics").json()["prefix_cache"]
    return results, metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=6, help="turns of each session")
    parser.add_argument("--port", type=int, default=18091)
    parser.add_argument("--kv-capacity", type=int, default=4096, help="the pool, in tokens")
    parser.add_argument("--host-gib", type=float, default=1.0, help="the host tier")
    parser.add_argument("--functions", type=int, default=12, help="~33 tokens each per turn")
    args = parser.parse_args()
    os.environ.setdefault("GOMP_SPINCOUNT", "10000000")
    runs = {}
    for host in (0.0, args.host_gib):
        extra = ("--kv-capacity", str(args.kv_capacity), "--prefix-min-tokens", "0")
        extra += ("--prefix-cache-host-gib", str(host))
        server = start_server(args.port, True, "default", extra)
        try:
            started = time.perf_counter()
            results, metrics = replay(args.port, args.turns, args.functions)
            runs[host] = (results, metrics, time.perf_counter() - started)
        finally:
            server.terminate()
            server.wait(30)
    (pool, pool_metrics, pool_wall), (tier, tier_metrics, tier_wall) = runs.values()
    print(f"pool {args.kv_capacity} tokens; host tier {args.host_gib} GiB in the second run")
    print(
        f"{'turn':>4} {'session':>7} {'prompt':>7} {'reusable':>8} "
        f"{'cached (pool)':>13} {'cached (+host)':>14} {'TTFT pool':>9} {'TTFT +host':>10}"
    )
    for index, ((name, off, reusable), (_, on, _)) in enumerate(zip(pool, tier, strict=True)):
        print(
            f"{index // 2 + 1:4d} {name:>7} {off.prompt_tokens:7d} {reusable:8d} "
            f"{off.cached_tokens:13d} {on.cached_tokens:14d} {off.ttft_s:9.3f} {on.ttft_s:10.3f}"
        )
    reusable = sum(r for _, _, r in pool)
    for label, run, metrics, wall in (
        ("pool alone", pool, pool_metrics, pool_wall),
        ("+ host tier", tier, tier_metrics, tier_wall),
    ):
        later = [turn.ttft_s for _, turn, _ in run[2:]]
        print(
            f"{label}: hit rate over reusable tokens "
            f"{sum(t.cached_tokens for _, t, _ in run) / max(reusable, 1):.1%}, "
            f"median TTFT after the first round {statistics.median(later):.3f} s, "
            f"host-tier hit tokens {metrics.get('host_hit_tokens', 0)}, spilled blocks "
            f"{metrics.get('host_spilled_blocks', 0)}, wall {wall:.1f} s"
        )
    ratio = statistics.median(t.ttft_s for _, t, _ in tier[2:]) / statistics.median(
        t.ttft_s for _, t, _ in pool[2:]
    )
    print(f"TTFT after the first round, + host tier / pool alone: {ratio:.2f}")


if __name__ == "__main__":
    main()
