"""The prefix cache inside the engine: exact outputs, skipped computation, floor and opt-out."""

from __future__ import annotations

from pathlib import Path

import pytest

from dgpp.engine import LLM, SamplingParams
from dgpp.engine.engine import LLMEngine
from tests.conftest import build_tiny_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SHARED = list(range(1000, 1040))  # a 40-token "system prompt"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), tokenizer_dir, "Qwen3ForCausalLM")


def _llm(checkpoint: Path, **knobs: object) -> LLM:
    options = {"kv_capacity": 512, "block_size": 4, "prefix_min_tokens": 0, **knobs}
    return LLM(str(checkpoint), **options)


def _run(engine: LLMEngine, prompt: list[int], **kwargs: object) -> list[int]:
    request = engine.add_request(prompt, GREEDY, **kwargs)
    tokens: list[int] = []
    while engine.has_unfinished():
        for output in engine.step():
            if output.request_id == request.request_id and output.finished:
                tokens = list(output.outputs[0].token_ids)
    return tokens


def test_greedy_output_with_the_cache_equals_without(checkpoint: Path) -> None:
    prompts = [SHARED + [7, 8, 9], SHARED + [7, 8], SHARED[:23] + [5], SHARED + [7, 8, 9, 10, 11]]
    on, off = _llm(checkpoint), _llm(checkpoint, prefix_cache=False)
    for prompt in prompts:  # one at a time, so later prompts hit what earlier ones cached
        assert _run(on.engine, prompt) == _run(off.engine, prompt)
    assert on.engine.counters.prefix_cache.hit_tokens > 0
    assert off.engine.counters.prefix_cache.hit_tokens == 0
    batched = on.generate(prompts, GREEDY)  # and batched, hitting the cache from the start
    alone = [_run(off.engine, prompt) for prompt in prompts]
    assert [list(o.outputs[0].token_ids) for o in batched] == alone


def test_a_shared_prefix_is_not_computed_again(checkpoint: Path) -> None:
    engine = _llm(checkpoint).engine
    _run(engine, SHARED + [1, 2, 3])  # 43 tokens: blocks of 40 shared tokens get cached
    before = engine.counters.prompt_tokens_computed
    second = SHARED + [4, 5, 6, 7, 8, 9]  # 46 tokens
    _run(engine, second)
    computed = engine.counters.prompt_tokens_computed - before
    assert computed == len(second) - 40  # exactly the 6 new tokens
    cache = engine.counters.prefix_cache
    assert (cache.queries, cache.hits, cache.misses, cache.hit_tokens) == (2, 1, 1, 40)


def test_the_last_prompt_token_is_always_recomputed(checkpoint: Path) -> None:
    engine = _llm(checkpoint).engine
    _run(engine, SHARED)  # 40 tokens = 10 full blocks
    before = engine.counters.prompt_tokens_computed
    _run(engine, SHARED)  # identical prompt: 9 blocks hit, the last block is recomputed
    assert engine.counters.prompt_tokens_computed - before == 4
    assert engine.counters.prefix_cache.hit_tokens == 36


def test_previous_reply_is_reused_by_the_next_turn(checkpoint: Path) -> None:
    engine = _llm(checkpoint).engine
    first = SHARED + [1, 2]
    reply = _run(engine, first)
    before = engine.counters.prompt_tokens_computed
    turn_two = first + reply + [3, 4, 5]  # 42 + 8 + 3 = 53 tokens
    _run(engine, turn_two)
    # Blocks of prompt and reply whose KV was computed (all but the last sampled token) hit.
    assert engine.counters.prompt_tokens_computed - before <= 53 - 48


def test_floor_and_opt_out(checkpoint: Path) -> None:
    engine = _llm(checkpoint, prefix_min_tokens=100).engine
    _run(engine, SHARED + [1])  # under the floor: computed, not inserted
    cache = engine.counters.prefix_cache
    assert cache.inserted_blocks == 0 and cache.skipped_inserts == 1
    long_prompt = SHARED * 3  # 120 tokens: inserted
    _run(engine, long_prompt)
    assert cache.inserted_blocks > 0
    _run(engine, long_prompt[:60] + [9])  # a short prompt may still hit
    assert cache.hits == 1 and cache.hit_tokens == 60
    before = engine.counters.prompt_tokens_computed
    _run(engine, long_prompt + [1], use_prefix_cache=False)  # opted out: full recompute
    assert engine.counters.prompt_tokens_computed - before == 121
    assert cache.queries == 3  # the opted-out request did not query


def test_a_full_pool_never_fails_a_request(checkpoint: Path) -> None:
    llm = _llm(checkpoint, kv_capacity=64)  # 16 blocks; every prompt needs 12+ of them
    prompts = [list(range(2000 + 50 * i, 2048 + 50 * i)) for i in range(6)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert all(o.finished and len(o.outputs[0].token_ids) == 6 for o in outputs)
    engine = llm.engine
    assert engine.block_manager.cache.num_evictions > 0
    assert engine.block_manager.num_used_blocks == 0
    stats = engine.stats()
    assert stats.counters.prefix_cache.evictions == engine.block_manager.cache.num_evictions
