"""The thinking budget (issue 66): does an agent always get an answer when thinking could eat
`max_tokens`? The default model behind a template that opens `<think>` (it never closes the block
by itself: a worst case), `--requests` chat requests with `reasoning_effort: low` and `max_tokens`
600, sampled (temperature 0.8, a seed each); beside them the same rendered prompts through
/v1/completions, where no budget applies (what an engine without one returns), in one run.

    .venv/bin/python bench/thinking_budget.py [--requests 20] [--max-tokens 600]

Prints, per path, how many answers were non-empty, the reasoning tokens (median, max) and the
answer tokens (median).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import statistics
import tempfile
from pathlib import Path

import httpx
from agent_replay import start_server

from dgpp.appliance.models.store import resolve_model

TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
QUESTIONS = [
    "Why does my Python test hang on CI but not locally?",
    "Refactor this loop into a list comprehension.",
    "What is the difference between a process and a thread?",
    "Fix the off-by-one error in my binary search.",
    "How do I make this SQL query use the index?",
]


def thinking_checkpoint(folder: Path) -> Path:
    """The default model's files, linked, behind TEMPLATE."""
    source = resolve_model("default")
    for item in source.iterdir():
        if item.name != "chat_template.jinja":
            os.symlink(item, folder / item.name)
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    return folder


def ask_chat(url: str, number: int, max_tokens: int) -> tuple[int, int]:
    body = {
        "model": "think", "max_tokens": max_tokens, "temperature": 0.8, "seed": number,
        "reasoning_effort": "low",
        "messages": [{"role": "user", "content": QUESTIONS[number % len(QUESTIONS)]}],
    }  # fmt: skip
    answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=900).json()
    message = answer["choices"][0]["message"]
    tokens = answer["usage"]["completion_tokens"]
    content = (message.get("content") or "").strip()
    reasoning = message.get("reasoning_content") or ""
    return _count(url, reasoning), (tokens - _count(url, reasoning)) if content else 0


def ask_plain(url: str, number: int, max_tokens: int) -> tuple[int, int]:
    messages = [{"role": "user", "content": QUESTIONS[number % len(QUESTIONS)]}]
    prompt = httpx.post(f"{url}/tokenize", json={"messages": messages}).json()["tokens"]
    body = {"model": "think", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8,
            "seed": number}  # fmt: skip
    text = httpx.post(f"{url}/v1/completions", json=body, timeout=900).json()["choices"][0]["text"]
    reasoning, closed, rest = text.partition("</think>")
    return _count(url, reasoning), _count(url, rest) if closed and rest.strip() else 0


def _count(url: str, text: str) -> int:
    body = {"prompt": text, "add_special_tokens": False}
    return len(httpx.post(f"{url}/tokenize", json=body).json()["tokens"]) if text else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=600)
    parser.add_argument("--port", type=int, default=18093)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = thinking_checkpoint(Path(folder))
        extra = ("--served-model-name", "think", "--max-model-len", "2048")
        server = start_server(args.port, True, str(checkpoint), extra)
        url = f"http://127.0.0.1:{args.port}"
        try:
            results = {}
            for path, ask in (("chat, reasoning_effort low", ask_chat),
                              ("completions, no budget", ask_plain)):  # fmt: skip
                with concurrent.futures.ThreadPoolExecutor(args.requests) as pool:
                    futures = [pool.submit(ask, url, n, args.max_tokens)
                               for n in range(args.requests)]  # fmt: skip
                    results[path] = [future.result() for future in futures]
        finally:
            server.terminate()
            server.wait(60)
    print(f"\n{args.requests} requests, max_tokens {args.max_tokens}, the default model behind a "
          "template that opens <think>\n")  # fmt: skip
    print("| path | non-empty answers | reasoning tokens (median, max) | answer tokens (median) |")
    print("|---|---|---|---|")
    for path, rows in results.items():
        answered = [answer for _, answer in rows if answer]
        thinking = [reasoning for reasoning, _ in rows]
        print(
            f"| {path} | {len(answered)}/{len(rows)} | {statistics.median(thinking):.0f}, "
            f"{max(thinking)} | {statistics.median(answered) if answered else 0:.0f} |"
        )


if __name__ == "__main__":
    main()
