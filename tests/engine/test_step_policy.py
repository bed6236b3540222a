"""The interactive step policy: a short prompt arriving during a long prefill runs in the next
step, a long prompt under a steady stream of short ones still finishes in bounded time, the
step budget shrinks to a target step time while streams decode, and greedy outputs do not
change (tiny random-weight model, with the prefix cache, speculative decoding and preemption)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from dgpp.engine import LLM, SamplingParams
from dgpp.engine.step_policy import MIN_CHUNK, StepPolicy
from dgpp.engine.step_times import StepTimes
from tests.conftest import build_tiny_checkpoint
from tests.engine.test_scheduler import Simulation, chunk_summary


def _sim(budget: int, short: int, share: float = 0.25, blocks: int = 256) -> Simulation:
    sim = Simulation(num_blocks=blocks, block_size=4, prefill_chunk_tokens=budget)
    sim.scheduler.policy = StepPolicy(budget, short, share)
    return sim


def test_a_short_prompt_arriving_during_a_long_prefill_runs_in_the_next_step() -> None:
    sim = _sim(budget=16, short=8)
    sim.add("long", 200, num_outputs=2)
    assert chunk_summary(sim.step()) == [("long", 0, 16)]
    sim.add("short", 5, num_outputs=3)
    # The short prompt whole, at once; the long one keeps advancing with the rest.
    assert sorted(chunk_summary(sim.step())) == [("long", 16, 11), ("short", 0, 5)]
    plan = sim.step()  # the short one decodes; the long prefill takes the whole budget again
    assert sorted(chunk_summary(plan)) == [("long", 27, 16), ("short", 5, 1)]


def test_the_prompt_class_is_the_prefill_left_at_admission() -> None:
    sim = _sim(budget=16, short=8)
    long_request, short_request = sim.add("long", 200, 1), sim.add("short", 8, 1)
    assert long_request.prompt_class is None  # not admitted yet
    sim.step()
    assert (long_request.prompt_class, short_request.prompt_class) == ("long", "short")


def test_the_oldest_long_prompt_keeps_its_share_under_steady_short_traffic() -> None:
    budget, share = 16, 0.25
    sim = _sim(budget=budget, short=8, share=share, blocks=4096)
    sim.add("long", 400, num_outputs=1)
    long_request = sim.scheduler.waiting[0]
    steps = 0
    while long_request in sim.scheduler.requests.values():  # until its one token is sampled
        for index in range(3):  # more short work arrives than the budget could ever serve
            sim.add(f"s{steps}-{index}", 8, num_outputs=2)
        sim.step()
        steps += 1
        assert steps < 1000
    assert steps <= math.ceil(400 / math.ceil(budget * share)) + 1  # bounded by the share


def test_a_budget_too_small_to_share_goes_to_the_older_prompt() -> None:
    sim = _sim(budget=1, short=4)
    sim.add("long", 20, num_outputs=1)
    sim.step()
    sim.add("short", 3, num_outputs=1)
    assert chunk_summary(sim.step()) == [("long", 1, 1)]  # the long one is older


def _times(decode_s: float, per_token_s: float, slope_s: float = 0.0) -> StepTimes:
    """Step times learned from steps costing `decode_s` plus, per prompt token at position p,
    `per_token_s + slope_s * p`."""
    times = StepTimes()
    for index in range(40):
        times.observe(decode_s, num_decodes=4, prompt_chunks=[])
        start, n = 512 * (index % 8), 512
        cost = n * (per_token_s + slope_s * (start + n / 2))
        times.observe(decode_s + cost, num_decodes=4, prompt_chunks=[(start, n)])
    return times


def test_the_step_time_model_fits_base_and_position_cost() -> None:
    times = _times(0.020, 0.001, slope_s=1e-7)
    assert times.decode_step_s == pytest.approx(0.020)
    a, b = times.token_cost()
    assert a == pytest.approx(0.001, rel=1e-6) and b == pytest.approx(1e-7, rel=1e-6)
    assert times.prompt_seconds(100, 1000) == pytest.approx(100 * (0.001 + 1e-7 * 1050))
    assert times.tokens_within(times.prompt_seconds(100, 1000), 1000, 512) == 100
    assert times.tokens_within(1.0, 0, 64) == 64 and times.tokens_within(-1.0, 0, 64) == 0


def _requests(*lengths: int) -> list:
    from dgpp.engine.request import Request

    return [
        Request(f"r{i}", list(range(n)), SamplingParams(), max_tokens=1)
        for i, n in enumerate(lengths)
    ]


def test_long_prompts_are_cut_to_the_step_target_while_latency_matters() -> None:
    times = _times(0.020, 0.001)  # 20 ms decode-only steps, 1 ms per prompt token
    policy = StepPolicy(prefill_chunk_tokens=512, short_prompt_tokens=64)
    (long_request,) = _requests(4000)
    full = {id(long_request): 512}
    # Nobody waits on a token: the whole budget.
    assert policy.bound(full, [long_request], 0, times) == full
    # Streams decode: (1.75 - 1) x 20 ms of prompt work, 15 tokens.
    assert policy.bound(full, [long_request], 4, times) == {id(long_request): 15}
    # A target the floor overrides: the oldest long prompt still gets MIN_CHUNK tokens.
    floor = StepPolicy(512, step_target_ms=20.5).bound(full, [long_request], 4, times)
    assert floor == {id(long_request): MIN_CHUNK}
    # A short prompt of 40 tokens in the step: 0.75 x (20 + 40) ms -> 45 long tokens.
    other_long, short_request = _requests(4000, 40)
    amounts = {id(other_long): 472, id(short_request): 40}
    bounded = policy.bound(amounts, [other_long, short_request], 0, times)
    assert bounded == {id(other_long): 45, id(short_request): 40}
    # An explicit target, or none.
    assert StepPolicy(512, step_target_ms=120).bound(full, [long_request], 4, times) == {
        id(long_request): 100
    }
    assert StepPolicy(512, step_target_ms=-1).bound(
        {id(long_request): 512}, [long_request], 4, times
    ) == {id(long_request): 512}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), tokenizer_dir, "LlamaForCausalLM")


@pytest.mark.parametrize("speculative", ["off", "ngram"])
def test_greedy_outputs_do_not_change_with_the_policy(checkpoint: Path, speculative: str) -> None:
    shared = list(range(400, 440))  # a common prefix: the prefix cache serves later requests
    prompts = [shared + list(range(600, 700)), [5, 6, 7], shared + [9, 9, 9], list(range(50, 62))]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    knobs = {"block_size": 4, "prefix_min_tokens": 8, "speculative": speculative}
    alone = [
        list(
            LLM(str(checkpoint), kv_capacity=1024, **knobs)
            .generate([p], params)[0]
            .outputs[0]
            .token_ids
        )
        for p in prompts
    ]
    # A small pool (preemption), a small budget and a short-prompt threshold that splits them.
    llm = LLM(
        str(checkpoint), kv_capacity=192, prefill_chunk_tokens=16, short_prompt_tokens=16, **knobs
    )
    together = llm.generate(prompts, params)
    assert [list(o.outputs[0].token_ids) for o in together] == alone
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.num_used_blocks == 0
    # Each request counted once in its prompt class (the metrics' split): the 100-token tail is
    # long, the 3- and 12-token prompts short whatever the cache held.
    classes = llm.engine.stats().counters.prompt_classes
    assert sum(c.count for c in classes.values()) == len(prompts)
    assert classes["long"].count >= 1 and classes["short"].count >= 2
    assert all(c.ttft_sum_s >= c.queue_sum_s >= 0 for c in classes.values())
