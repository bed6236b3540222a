"""Continuous batching, chunked prefill, preemption, cancellation and block accounting."""

from __future__ import annotations

from pathlib import Path

import pytest

from dgpp.engine import LLM, SamplingParams
from tests.conftest import build_tiny_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), tokenizer_dir, "LlamaForCausalLM")


def _alone(checkpoint: Path, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
    llm = LLM(str(checkpoint), kv_capacity=1024, block_size=4)
    return list(llm.generate([prompt], params)[0].outputs[0].token_ids)


def test_request_joining_mid_flight_matches_running_alone(checkpoint: Path) -> None:
    first, second = list(range(200, 230)), list(range(900, 917))
    llm = LLM(str(checkpoint), kv_capacity=1024, block_size=4, prefill_chunk_tokens=8)
    engine = llm.engine
    engine.add_request(first, GREEDY, "first")
    results: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished():
        if steps == 6:  # `first` is decoding by now; `second` joins the running batch
            engine.add_request(second, GREEDY, "second")
        for output in engine.step():
            if output.finished:
                results[output.request_id] = list(output.outputs[0].token_ids)
        steps += 1
    assert results["first"] == _alone(checkpoint, first)
    assert results["second"] == _alone(checkpoint, second)


def test_long_prompt_is_chunked_while_decodes_continue(checkpoint: Path) -> None:
    llm = LLM(str(checkpoint), kv_capacity=1024, block_size=4, prefill_chunk_tokens=8)
    engine = llm.engine
    engine.add_request([5, 6, 7], GREEDY, "short")
    engine.step()  # short prompt prefilled; it decodes from now on
    engine.add_request(list(range(300, 364)), GREEDY, "long")  # 64 tokens = 8 chunks
    decoded_during_prefill = 0
    for _ in range(8):
        outputs = {o.request_id: o for o in engine.step()}
        decoded_during_prefill += "short" in outputs
    assert decoded_during_prefill == 8  # a decode row ran in every step of the long prefill
    while engine.has_unfinished():
        engine.step()


def test_preemption_under_a_small_pool_keeps_outputs_exact(checkpoint: Path) -> None:
    prompts = [list(range(100 + 40 * i, 120 + 40 * i)) for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    # 4 requests x 40 tokens need 160 slots; the pool has 64, so requests are preempted and
    # recomputed, and everything must still finish with the tokens each gets alone.
    llm = LLM(str(checkpoint), kv_capacity=64, block_size=4, prefill_chunk_tokens=16)
    outputs = llm.generate(prompts, params)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert list(output.outputs[0].token_ids) == _alone(checkpoint, prompt, params)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.num_used_blocks == 0


def test_cancellation_returns_every_block(checkpoint: Path) -> None:
    llm = LLM(str(checkpoint), kv_capacity=256, block_size=4)
    engine = llm.engine
    engine.add_request(list(range(50, 90)), SamplingParams(max_tokens=100, ignore_eos=True), "a")
    engine.add_request(list(range(10, 20)), SamplingParams(max_tokens=100, ignore_eos=True), "b")
    for _ in range(3):
        engine.step()
    assert engine.block_manager.num_used_blocks > 0
    engine.abort("a")
    engine.abort("b")
    outputs = engine.step()
    assert {o.request_id for o in outputs} == {"a", "b"}
    assert all(o.finished and o.outputs[0].finish_reason == "abort" for o in outputs)
    assert engine.block_manager.num_used_blocks == 0
    assert not engine.has_unfinished()


def test_waiting_request_can_be_cancelled(checkpoint: Path) -> None:
    llm = LLM(str(checkpoint), kv_capacity=256, block_size=4, max_concurrency=1)
    engine = llm.engine
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True), "running")
    engine.add_request([4, 5, 6], SamplingParams(max_tokens=50, ignore_eos=True), "queued")
    engine.step()
    assert [r.request_id for r in engine.scheduler.waiting] == ["queued"]
    engine.abort("queued")
    outputs = engine.step()
    assert any(o.request_id == "queued" and o.finished for o in outputs)
    assert not engine.scheduler.waiting


def test_completion_returns_every_block_and_respects_max_concurrency(checkpoint: Path) -> None:
    llm = LLM(str(checkpoint), kv_capacity=512, block_size=4, max_concurrency=2)
    engine = llm.engine
    for index in range(5):
        engine.add_request([10 + index] * 7, SamplingParams(max_tokens=6, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
        assert len(engine.scheduler.running) <= 2
    assert engine.block_manager.num_used_blocks == 0


def test_stop_string_ends_the_request(checkpoint: Path) -> None:
    llm = LLM(str(checkpoint), kv_capacity=512)
    free = llm.generate([list(range(400, 420))], GREEDY)[0].outputs[0]
    assert len(free.text) > 6
    stop = free.text[3:6]
    stopped = llm.generate(
        [list(range(400, 420))], SamplingParams(temperature=0, max_tokens=16, stop=[stop])
    )[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.text == free.text[: free.text.index(stop)]


def test_eos_and_stop_token_ids_finish_with_stop(checkpoint: Path) -> None:
    llm = LLM(str(checkpoint), kv_capacity=512)
    tokens = _alone(checkpoint, list(range(400, 420)))
    output = llm.generate(
        [list(range(400, 420))],
        SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[tokens[4]]),
    )[0].outputs[0]
    assert output.finish_reason == "stop" and output.stop_reason == tokens[4]
    assert list(output.token_ids) == tokens[: tokens.index(tokens[4]) + 1]


def test_seeded_sampling_is_reproducible_across_batches(checkpoint: Path) -> None:
    llm = LLM(str(checkpoint), kv_capacity=1024)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=1234, ignore_eos=True)
    alone = llm.generate([[7, 8, 9]], params)[0].outputs[0].token_ids
    noisy = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    batched = llm.generate([[1, 2], [7, 8, 9], [3, 4, 5, 6]], [noisy, params, noisy])
    assert batched[1].outputs[0].token_ids == alone


def test_logprobs_are_returned(checkpoint: Path) -> None:
    llm = LLM(str(checkpoint), kv_capacity=512)
    output = llm.generate([[7, 8, 9]], SamplingParams(temperature=0, max_tokens=4, logprobs=3))
    completion = output[0].outputs[0]
    assert completion.logprobs is not None and len(completion.logprobs) == 4
    for token_id, entry in zip(completion.token_ids, completion.logprobs, strict=True):
        assert entry.token_id == token_id and entry.rank == 1 and len(entry.top) == 3
        assert entry.top[0][0] == token_id and entry.logprob <= 0.0


def test_live_knobs_retune_the_step_policy_mid_flight_and_outputs_stay_exact(
    checkpoint: Path,
) -> None:
    """`retune` (a live reload) swaps the step policy between two steps: the request in flight
    goes on under the new one and its greedy tokens stay those of running alone."""
    from dataclasses import replace

    prompt = list(range(200, 260))
    llm = LLM(str(checkpoint), kv_capacity=1024, block_size=4, prefill_chunk_tokens=8)
    engine = llm.engine
    engine.add_request(prompt, GREEDY, "tuned")
    engine.step()
    tuned = replace(engine.config, short_prompt_tokens=4, long_prefill_share=0.5)
    engine.retune(
        replace(
            tuned,
            step_target_ms=-1.0,
            arrival_hold_ms=250.0,
            session_ttl_s=5.0,
            priority_aging_s=2.0,
        )
    )
    assert engine.block_manager.sessions.table.ttl_s == 5.0
    assert engine.scheduler.aging_s == 2.0
    policy = engine.scheduler.policy
    assert (policy.short_prompt_tokens, policy.long_prefill_share) == (4, 0.5)
    assert policy.arrival_hold_s == 0.25
    assert policy.step_target_ms == -1.0 and engine.config.step_target_ms == -1.0
    tokens: list[int] = []
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                tokens = list(output.outputs[0].token_ids)
    assert tokens == _alone(checkpoint, prompt)
