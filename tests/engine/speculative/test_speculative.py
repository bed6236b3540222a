"""Speculative decoding (n-gram lookup): what is generated never changes, drafts are accepted
where the text repeats, and rejected drafts leave neither KV blocks nor cache entries behind."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dgpp.engine import LLM, SamplingParams
from dgpp.engine.errors import ConfigError
from dgpp.engine.scheduling.request import Request
from dgpp.engine.scheduling.stats import SpecCounters
from dgpp.engine.speculative.ngram import NgramProposer, lookup
from tests.conftest import build_tiny_checkpoint

CODE = """def merge(left: list[int], right: list[int]) -> list[int]:
    out: list[int] = []
    i = j = 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            out.append(left[i])
            i += 1
        else:
            out.append(right[j])
            j += 1
    return out + left[i:] + right[j:]
"""


def _tokens(llm: LLM, prompts: list[Any], params: SamplingParams | list[SamplingParams]) -> list:
    return [list(output.outputs[0].token_ids) for output in llm.generate(prompts, params)]


def _chat(llm: LLM, text: str) -> str:
    messages = [{"role": "user", "content": text}]
    return llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), tokenizer_dir, "Qwen3ForCausalLM")


@pytest.fixture(scope="module")
def default_pair(default_checkpoint: Path) -> tuple[LLM, LLM]:
    knobs = {"kv_capacity": 4096, "num_threads": 2}
    plain = LLM(str(default_checkpoint), **knobs)
    spec = LLM(str(default_checkpoint), speculative="ngram", spec_depth=5, **knobs)
    return plain, spec


def test_lookup_takes_the_longest_ngram_and_its_latest_occurrence() -> None:
    tokens = np.array([1, 2, 3, 9, 9, 2, 3, 7, 8, 1, 2, 3])
    # The 3-gram (1, 2, 3) occurs at 0; the 2-gram (2, 3) later at 5: the longer match wins.
    assert lookup(tokens, 3, 1, 4) == (9, 9, 2, 3)
    assert lookup(tokens, 2, 1, 2) == (7, 8)  # (2, 3) latest at 5 -> 7, 8
    assert lookup(tokens, 3, 3, 20) == (9, 9, 2, 3, 7, 8, 1, 2, 3)  # runs to the end at most
    assert lookup(np.array([4, 5, 6, 7]), 3, 1, 4) == ()  # the last token never occurred before
    assert lookup(np.array([5, 5]), 2, 1, 3) == (5,)
    # In a run, the latest occurrence with a whole draft after it.
    assert lookup(np.array([3, 8, 8, 8, 8, 8]), 2, 1, 2) == (8, 8)


def test_proposer_limits_and_follows_a_growing_request() -> None:
    proposer = NgramProposer(depth=3, ngram_max=2, ngram_min=1)
    request = Request("r", [1, 2, 3, 4, 1, 2], SamplingParams(), max_tokens=10)
    assert proposer.propose(request, limit=10) == (3, 4, 1)  # depth caps it
    assert proposer.propose(request, limit=1) == (3,)
    assert proposer.propose(request, limit=0) == ()
    request.token_ids.append(3)  # the history array follows the request as it grows
    assert proposer.propose(request, limit=10) == (4, 1, 2)
    request.token_ids.extend([8] * 200)  # past the array's first capacity
    assert proposer.propose(request, limit=2) == (8, 8)
    with pytest.raises(ValueError, match="ngram_min"):
        NgramProposer(depth=3, ngram_max=1, ngram_min=2)


def test_counters_count_drafts_and_positions() -> None:
    counters = SpecCounters()
    counters.record(3, 2)
    counters.record(4, 0)
    counters.record(1, 1)
    assert (counters.drafts, counters.draft_tokens, counters.accepted_tokens) == (3, 8, 3)
    assert counters.accepted_per_position == [2, 1, 0, 0]


@pytest.mark.parametrize(
    "bad",
    [
        {"speculative": "eagle"},
        {"spec_depth": 0},
        {"spec_ngram_min": 3, "spec_ngram_max": 2},
        {"spec_ngram_max": True},
    ],
)
def test_bad_speculative_knobs_are_refused(tiny: Path, bad: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        LLM(str(tiny), **bad)


def test_default_model_greedy_output_is_unchanged_and_drafts_are_accepted(
    default_pair: tuple[LLM, LLM],
) -> None:
    plain, spec = default_pair
    prompts = [
        _chat(plain, "Repeat this code exactly, with no comment:\n" + CODE),
        _chat(plain, "What is the capital of France? Answer in one sentence."),
        _chat(plain, "Rename `out` to `result` in this function:\n" + CODE),
    ]
    params = SamplingParams(temperature=0.0, max_tokens=48)
    before = spec.engine.counters.spec_decode.accepted_tokens
    assert _tokens(spec, prompts, params) == _tokens(plain, prompts, params)
    counters = spec.engine.counters.spec_decode
    assert counters.accepted_tokens - before > 20  # the copied code is drafted and accepted
    assert counters.accepted_tokens <= counters.draft_tokens
    assert sum(counters.accepted_per_position) == counters.accepted_tokens
    assert len(counters.accepted_per_position) <= 5
    # Fewer steps than tokens: several tokens per verify row.
    assert spec.engine.counters.num_steps < plain.engine.counters.num_steps
    assert spec.engine.block_manager.num_used_blocks == 0  # nothing held after the batch


def test_default_model_seeded_sampling_with_penalties_is_unchanged(
    default_pair: tuple[LLM, LLM],
) -> None:
    plain, spec = default_pair
    prompt = _chat(plain, "Repeat this code exactly:\n" + CODE)
    params = [
        SamplingParams(temperature=0.7, top_p=0.9, seed=7, max_tokens=40),
        SamplingParams(temperature=1.0, top_k=20, seed=11, max_tokens=40, repetition_penalty=1.1),
        SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.3, max_tokens=40),
    ]
    prompts = [prompt] * len(params)
    assert _tokens(spec, prompts, params) == _tokens(plain, prompts, params)


def test_stop_strings_max_tokens_and_logprobs_are_unchanged(
    default_pair: tuple[LLM, LLM],
) -> None:
    plain, spec = default_pair
    prompt = _chat(plain, "Repeat this code exactly:\n" + CODE)
    for params in (
        SamplingParams(temperature=0.0, max_tokens=40, stop=("j += 1",)),
        SamplingParams(temperature=0.0, max_tokens=7),
        SamplingParams(temperature=0.0, max_tokens=24, logprobs=3),
    ):
        ours, theirs = spec.generate(prompt, params)[0], plain.generate(prompt, params)[0]
        mine, ref = ours.outputs[0], theirs.outputs[0]
        assert (mine.token_ids, mine.text, mine.finish_reason, mine.stop_reason) == (
            ref.token_ids,
            ref.text,
            ref.finish_reason,
            ref.stop_reason,
        )
        assert len(mine.token_ids) <= params.max_tokens
        if params.logprobs:
            assert mine.logprobs is not None and ref.logprobs is not None
            for got, want in zip(mine.logprobs, ref.logprobs, strict=True):
                assert got.token_id == want.token_id and got.rank == want.rank
                assert got.logprob == pytest.approx(want.logprob, abs=1e-3)
                assert [t for t, _ in got.top] == [t for t, _ in want.top]


def test_tiny_model_under_pool_pressure_matches_plain(tiny: Path) -> None:
    """A pool too small for the batch: drafts fall back to plain rows, requests are preempted
    and recomputed, and every output still equals plain decoding's."""
    knobs = {"kv_capacity": 160, "block_size": 4, "prefill_chunk_tokens": 16, "num_threads": 1}
    plain = LLM(str(tiny), **knobs)
    spec = LLM(str(tiny), speculative="ngram", spec_depth=4, spec_ngram_min=1, **knobs)
    prompts = [list(range(300, 312)) * 3, [5, 6, 7, 5, 6, 7, 5, 6], list(range(1000, 1020))]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    assert _tokens(spec, prompts, params) == _tokens(plain, prompts, params)
    counters = spec.engine.counters
    assert counters.spec_decode.draft_tokens > 0
    assert counters.num_preemptions > 0
    assert spec.engine.block_manager.num_used_blocks == 0


def test_blocks_computed_while_verifying_serve_later_prefix_hits(tiny: Path) -> None:
    """The next turn (prompt + reply + more) hits blocks whose KV was written by verify rows:
    their contents must be the accepted tokens' keys and values, not a rejected draft's."""
    knobs = {"kv_capacity": 1024, "block_size": 4, "prefix_min_tokens": 0, "num_threads": 1}
    spec = LLM(str(tiny), speculative="ngram", spec_ngram_min=1, **knobs)
    plain = LLM(str(tiny), prefix_cache=False, **knobs)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    first = list(range(300, 310)) * 2
    reply = _tokens(spec, [first], params)[0]
    assert reply == _tokens(plain, [first], params)[0]
    assert spec.engine.counters.spec_decode.accepted_tokens > 0
    turn_two = first + reply + [7, 8, 9]
    hits_before = spec.engine.counters.prefix_cache.hit_tokens
    assert _tokens(spec, [turn_two], params) == _tokens(plain, [turn_two], params)
    assert spec.engine.counters.prefix_cache.hit_tokens - hits_before >= len(first) + 16


def test_speculation_can_be_turned_off_per_knob(tiny: Path) -> None:
    llm = LLM(str(tiny), speculative="off", kv_capacity=256, block_size=4)
    _tokens(llm, [[5, 6, 7, 5, 6, 7, 5, 6]], SamplingParams(temperature=0.0, max_tokens=8))
    assert llm.engine.counters.spec_decode.drafts == 0
    assert llm.engine.stats().spec_depth == 0


def test_randomized_mixed_traffic_matches_plain(tiny: Path) -> None:
    """Many requests with repetitive and random prompts, greedy and seeded sampling, penalties,
    stop tokens and lengths, on a small pool, with requests arriving while others run and some
    aborted: every request that was not aborted gets exactly plain decoding's tokens, and the
    pool is empty at the end."""
    import random

    knobs = {"kv_capacity": 384, "block_size": 4, "prefill_chunk_tokens": 24, "num_threads": 1}
    plain = LLM(str(tiny), **knobs).engine
    spec = LLM(str(tiny), speculative="ngram", spec_depth=5, spec_ngram_min=1, **knobs).engine
    rng = random.Random(3)
    workload = []
    for index in range(24):
        unit = [rng.randrange(200, 2000) for _ in range(rng.randint(2, 6))]
        prompt = unit * rng.randint(1, 5) + [rng.randrange(200, 2000) for _ in range(3)]
        params = SamplingParams(
            temperature=rng.choice([0.0, 0.0, 0.8]),
            top_k=rng.choice([0, 20]),
            seed=rng.randrange(1000),
            max_tokens=rng.randint(1, 40),
            repetition_penalty=rng.choice([1.0, 1.0, 1.2]),
            stop_token_ids=tuple(rng.sample(unit, 1)) if index % 5 == 0 else (),
            ignore_eos=True,
        )
        workload.append((f"r{index}", prompt, params, index % 7 == 3))

    def serve(engine: Any) -> dict[str, list[int]]:
        done: dict[str, list[int]] = {}
        pending = list(workload)
        steps = 0
        while pending or engine.has_unfinished():
            for _ in range(min(len(pending), 3)):  # arrivals while others run
                request_id, prompt, params, _ = pending.pop(0)
                engine.add_request(prompt, params, request_id)
            steps += 1
            if steps == 4:
                for request_id, _, _, aborted in workload:
                    if aborted:
                        engine.abort(request_id)
            for output in engine.step():
                if output.finished:
                    done[output.request_id] = list(output.outputs[0].token_ids)
        assert engine.block_manager.num_used_blocks == 0
        return done

    expected, got = serve(plain), serve(spec)
    assert set(got) == set(expected) == {request_id for request_id, *_ in workload}
    for request_id, _, _, aborted in workload:
        if not aborted:
            assert got[request_id] == expected[request_id], request_id
    assert spec.counters.spec_decode.accepted_tokens > 0
    assert plain.counters.num_preemptions > 0 and spec.counters.num_preemptions > 0
