"""Agent sessions on a real engine (tiny Llama, greedy): an agent's conversation keeps its
cached prefix on the device while anonymous traffic twice the pool's size goes through, and its
next turn is a full hit with the tokens of an uncached run; the same traffic without a session
(block LRU) loses the prefix. The orders themselves: tests/engine/cache/test_sessions.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from dgpp.engine import LLM, SamplingParams
from tests.conftest import build_tiny_checkpoint


@pytest.mark.parametrize("session", ["agent-1", None], ids=["session", "block-lru"])
def test_a_session_keeps_its_prefix_through_anonymous_traffic(
    tmp_path: Path, tokenizer_dir: Path, session: str | None
) -> None:
    checkpoint = build_tiny_checkpoint(tmp_path, tokenizer_dir, "LlamaForCausalLM")
    llm = LLM(
        str(checkpoint), dtype="float32", block_size=4, kv_capacity=96, prefix_min_tokens=4,
        max_model_len=80,
    )  # fmt: skip

    def run(prompt: list[int], who: str | None) -> list[int]:
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, session=who)
        return list(llm.generate([prompt], params)[0].outputs[0].token_ids)

    first = list(range(100, 140))
    reply = run(first, session)
    for index in range(4):  # 4 x 50 tokens: twice the 24-block pool
        run(list(range(1000 + 100 * index, 1050 + 100 * index)), None)
    cache = llm.engine.counters.prefix_cache
    before = cache.hit_tokens
    turn = [*first, *reply, 7, 8, 9]
    got = run(turn, session)
    fresh = LLM(str(checkpoint), dtype="float32", block_size=4, prefix_cache=False)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    assert got == list(fresh.generate([turn], params)[0].outputs[0].token_ids)
    hit = cache.hit_tokens - before
    assert (hit >= len(first)) if session else (hit == 0), hit  # its whole first prompt, or none
