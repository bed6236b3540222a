"""Two coding-agent sessions alternating over a KV pool that holds about one of them: the
prefix cache with the device pool alone, with the host tier (`prefix_cache_host_gib`), and with
the host and disk tiers (`prefix_cache_disk_gib`); then a server restart and one more turn.

    .venv/bin/python bench/agent_tiers.py [--turns 6] [--kv-capacity 4096] [--host-gib 1]
        [--disk-gib 4]

Starts `dgpp serve` on the default model with `--kv-capacity` three times (no tier, the host tier,
both tiers, each with a fresh cache directory) and replays two sessions built as
bench/agent_replay.py builds one (a long system prompt with tool instructions, then user turns,
tool calls and tool results), each with its own opening line, turn by turn alternately (A1 B1 A2 B2
...) over the OpenAI streaming API. Each session grows past half the pool, so with the pool alone
each turn finds the other session's blocks where its own were. Prints per turn the prompt, the
tokens it shares with its session's previous prompt and reply (reusable), the cached tokens and
TTFT in the three runs, then the hit rate over reusable tokens and the TTFT ratio of each run's
turns after the first round. Each server is then stopped (SIGTERM) and started again, and each
session takes one more turn (rows marked R): only the disk tier still holds its history.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import httpx
from agent_replay import SYSTEM, chat, session_step, start_server

OPENING = {"A": "You maintain the billing service.", "B": "You maintain the search service."}


def _shared(tokens: list[int], previous: list[int]) -> int:
    shared = 0
    for a, b in zip(tokens, previous, strict=False):
        if a != b:
            break
        shared += 1
    return shared


class Sessions:
    """Both sessions' messages and what each one's previous prompt and reply were."""

    def __init__(self) -> None:
        self.messages = {
            name: [
                {"role": "system", "content": f"{opening}\n{SYSTEM}"},
                {"role": "user", "content": "Step 1: fix the failing handler."},
            ]
            for name, opening in OPENING.items()
        }
        self.previous: dict[str, list[int]] = {name: [] for name in self.messages}
        self.turn = 0


def replay(port: int, sessions: Sessions, turns: int, functions: int) -> tuple[list, dict]:
    """`turns` more turns of both sessions, alternately: (session, turn, reusable tokens) per
    request, and the server's prefix-cache metrics at the end."""
    results = []
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
        for _ in range(turns):
            for name, messages in sessions.messages.items():
                tokens = client.post("/tokenize", json={"messages": messages}).json()["tokens"]
                reusable = _shared(tokens, sessions.previous[name])
                result = chat(client, messages)
                results.append((name, result, reusable))
                reply = client.post(
                    "/tokenize", json={"prompt": result.reply, "add_special_tokens": False}
                ).json()["tokens"]
                sessions.previous[name] = tokens + reply
                session_step(messages, sessions.turn, result.reply, functions)
            sessions.turn += 1
        metrics = client.get("/v1/metrics").json()["prefix_cache"]
    return results, metrics


def run(args: argparse.Namespace, host: float, disk: float) -> tuple:
    """One server: the replay, then a restart (SIGTERM, start again) and one more turn of each
    session: (results, metrics, wall seconds, results after the restart, their metrics)."""
    folder = tempfile.mkdtemp(prefix="dgpp-agent-tiers-")
    extra = ("--kv-capacity", str(args.kv_capacity), "--prefix-min-tokens", "0")
    extra += ("--prefix-cache-host-gib", str(host), "--prefix-cache-disk-gib", str(disk))
    extra += ("--prefix-cache-dir", folder)
    sessions = Sessions()
    server = start_server(args.port, True, "default", extra)
    try:
        started = time.perf_counter()
        results, metrics = replay(args.port, sessions, args.turns, args.functions)
        wall = time.perf_counter() - started
    finally:
        server.terminate()
        server.wait(60)
    server = start_server(args.port, True, "default", extra)
    try:
        after, after_metrics = replay(args.port, sessions, 1, args.functions)
    finally:
        server.terminate()
        server.wait(60)
        shutil.rmtree(folder, ignore_errors=True)
    return results, metrics, wall, after, after_metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=6, help="turns of each session")
    parser.add_argument("--port", type=int, default=18091)
    parser.add_argument("--kv-capacity", type=int, default=4096, help="the pool, in tokens")
    parser.add_argument("--host-gib", type=float, default=1.0, help="the host tier")
    parser.add_argument("--disk-gib", type=float, default=4.0, help="the disk tier")
    parser.add_argument("--functions", type=int, default=12, help="~33 tokens each per turn")
    args = parser.parse_args()
    os.environ.setdefault("GOMP_SPINCOUNT", "10000000")
    labels = ("pool alone", "+ host tier", "+ host + disk tiers")
    tiers = ((0.0, 0.0), (args.host_gib, 0.0), (args.host_gib, args.disk_gib))
    runs = [run(args, host, disk) for host, disk in tiers]
    print(
        f"pool {args.kv_capacity} tokens; host tier {args.host_gib} GiB, disk tier "
        f"{args.disk_gib} GiB; the last turn of each session after a server restart"
    )
    print(
        f"{'turn':>4} {'session':>7} {'prompt':>7} {'reusable':>8} "
        + " ".join(f"{'cached ' + str(i + 1):>9}" for i in range(3))
        + " "
        + " ".join(f"{'TTFT ' + str(i + 1):>7}" for i in range(3))
    )
    rows = [[*results, *after] for results, _, _, after, _ in runs]
    for index, turns in enumerate(zip(*rows, strict=True)):
        name, first, reusable = turns[0]
        label = f"{index // 2 + 1}" + ("R" if index >= 2 * args.turns else "")
        print(
            f"{label:>4} {name:>7} {first.prompt_tokens:7d} {reusable:8d} "
            + " ".join(f"{turn.cached_tokens:9d}" for _, turn, _ in turns)
            + " "
            + " ".join(f"{turn.ttft_s:7.3f}" for _, turn, _ in turns)
        )
    reusable = sum(r for _, _, r in runs[0][0])
    for label, (results, metrics, wall, after, after_metrics) in zip(labels, runs, strict=True):
        later = [turn.ttft_s for _, turn, _ in results[2:]]
        restart = [turn.ttft_s for _, turn, _ in after]
        cached_after = sum(turn.cached_tokens for _, turn, _ in after)
        print(
            f"{label}: hit rate over reusable tokens "
            f"{sum(t.cached_tokens for _, t, _ in results) / max(reusable, 1):.1%}, "
            f"median TTFT after the first round {statistics.median(later):.3f} s, "
            f"host-tier hit tokens {metrics.get('host_hit_tokens', 0)}, wall {wall:.1f} s; "
            f"after the restart: cached {cached_after} of "
            f"{sum(r for _, _, r in after)} reusable, TTFT {max(restart):.3f} s at most, "
            f"disk-tier hit tokens {after_metrics.get('disk_hit_tokens', 0)}"
        )
    pool, host = runs[0], runs[1]
    ratio = statistics.median(t.ttft_s for _, t, _ in host[0][2:]) / statistics.median(
        t.ttft_s for _, t, _ in pool[0][2:]
    )
    print(f"TTFT after the first round, + host tier / pool alone: {ratio:.2f}")
    cold = statistics.median(t.ttft_s for _, t, _ in runs[1][3])
    warm = statistics.median(t.ttft_s for _, t, _ in runs[2][3])
    print(f"TTFT of the turn after a restart, + disk tier / without: {warm / cold:.2f}")


if __name__ == "__main__":
    main()
