"""The interactive step policy: a short prompt arriving during a long prefill runs in the next
step, a long prompt under a steady stream of short ones still finishes in bounded time, the
step budget shrinks to a target step time while streams decode, and greedy outputs do not
change (tiny random-weight model, with the prefix cache, speculative decoding and preemption)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from dgpp.engine import LLM, SamplingParams
from dgpp.engine.scheduling.step_policy import MAX_SKIPS, MIN_CHUNK, LongCredit, StepPolicy
from dgpp.engine.scheduling.step_times import StepTimes
from tests.conftest import build_tiny_checkpoint
from tests.engine.scheduling.test_scheduler import Simulation, chunk_summary


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


def _times(
    decode_s: float,
    per_token_s: float,
    slope_s: float = 0.0,
    context_s: float = 0.0,
    chunk_s: float = 0.0,
) -> StepTimes:
    """Step times learned from steps costing `decode_s` plus, per prompt chunk of n tokens from
    position s, `n * (per_token_s + slope_s * (s + n / 2)) + context_s * (s + n) + chunk_s`:
    chunks of several sizes at several positions, as bounded and whole steps give."""
    times = StepTimes()
    for index in range(60):
        times.observe(decode_s, num_decodes=4, prompt_chunks=[])
        start, n = 512 * (index % 8), (16, 64, 512)[index % 3]
        cost = n * (per_token_s + slope_s * (start + n / 2)) + context_s * (start + n) + chunk_s
        times.observe(decode_s + cost, num_decodes=4, prompt_chunks=[(start, n)])
    return times


def test_the_step_time_model_fits_base_token_position_and_chunk_costs() -> None:
    times = _times(0.020, 0.001, slope_s=1e-7, context_s=2e-6, chunk_s=0.003)
    assert times.decode_step_s == pytest.approx(0.020)
    a, b, c, d = times.terms()
    assert a == pytest.approx(0.001, rel=1e-3) and b == pytest.approx(1e-7, rel=1e-3)
    assert c == pytest.approx(2e-6, rel=1e-2) and d == pytest.approx(0.003, rel=1e-2)
    cost = 100 * (0.001 + 1e-7 * 1050) + 2e-6 * 1100 + 0.003
    assert times.prompt_seconds(100, 1000) == pytest.approx(cost, rel=1e-3)
    assert times.tokens_within(times.prompt_seconds(100, 1000) + 1e-6, 1000, 512) == 100
    assert times.tokens_within(1.0, 0, 64) == 64 and times.tokens_within(-1.0, 0, 64) == 0
    # Not even the chunk's fixed costs fit: no tokens.
    assert times.tokens_within(0.003, 1000, 512) == 0
    # Costs no term explains are not fitted as negative ones.
    flat = _times(0.020, 0.001)
    assert all(term >= 0 for term in flat.terms())
    assert flat.prompt_seconds(32, 0) == pytest.approx(0.032, rel=1e-3)


def _requests(*lengths: int) -> list:
    from dgpp.engine.scheduling.request import Request

    return [
        Request(f"r{i}", list(range(n)), SamplingParams(), max_tokens=1)
        for i, n in enumerate(lengths)
    ]


def test_long_prompts_are_cut_to_the_step_target_while_latency_matters() -> None:
    times = _times(0.020, 0.001)  # 20 ms decode-only steps, 1 ms per prompt token
    policy = StepPolicy(prefill_chunk_tokens=512, short_prompt_tokens=64)
    (long_request,) = _requests(4000)
    now = long_request.arrival_time + 10.0  # long after any arrival
    full = {id(long_request): 512}
    # Nobody waits on a token and none arrived lately: the whole budget.
    assert policy.bound(full, [long_request], 0, times, now) == full
    assert policy.bound(full, [long_request], 0, times, now, last_arrival=now - 2.0) == full
    # Streams decode: (1.75 - 1) x 20 ms of prompt work, 15 tokens.
    assert policy.bound(full, [long_request], 4, times, now) == {id(long_request): 15}
    # A target that leaves no token: the oldest long prompt sits the step out, banking the
    # time, and spends it once a token's worth is banked (with the MIN_CHUNK floor).
    tight, credit = StepPolicy(512, step_target_ms=20.5), LongCredit()
    assert tight.bound(full, [long_request], 4, times, now, credit=credit) == {}
    assert credit.seconds == pytest.approx(0.0005)
    assert tight.bound(full, [long_request], 4, times, now, credit=credit) == {
        id(long_request): MIN_CHUNK
    }
    assert credit.seconds == 0.0
    # With nothing to spare at all, it sits out MAX_SKIPS steps in a row at most.
    nothing = StepPolicy(512, step_target_ms=20.0)
    for _ in range(MAX_SKIPS):
        assert nothing.bound(full, [long_request], 4, times, now, credit=credit) == {}
    floor = nothing.bound(full, [long_request], 4, times, now, credit=credit)
    assert floor == {id(long_request): MIN_CHUNK}
    # A short prompt of 40 tokens in the step as it arrives: 0.75 x (20 + 40) ms -> 45 long
    # tokens, which is also its deadline (1.75 x its solo 60 ms after its arrival).
    other_long, short_request = _requests(4000, 40)
    amounts = {id(other_long): 472, id(short_request): 40}
    arrived = short_request.arrival_time
    bounded = policy.bound(amounts, [other_long, short_request], 0, times, arrived)
    assert bounded == {id(other_long): 45, id(short_request): 40}
    # The same short prompt after waiting 50 ms for a step in progress: its deadline leaves the
    # long prompt nothing, so it sits the step out.
    late = policy.bound(amounts, [other_long, short_request], 0, times, arrived + 0.050)
    assert late == {id(short_request): 40}
    # An explicit target, or none.
    assert StepPolicy(512, step_target_ms=120).bound(full, [long_request], 4, times, now) == {
        id(long_request): 100
    }
    assert StepPolicy(512, step_target_ms=-1).bound(
        {id(long_request): 512}, [long_request], 4, times, now
    ) == {id(long_request): 512}


def test_a_long_only_step_is_bounded_while_an_arrival_is_likely() -> None:
    times = _times(0.010, 0.001)  # a typical short prompt (32 tokens) alone: a 42 ms step
    assert times.solo_short_s() == pytest.approx(0.042, rel=1e-4)
    policy = StepPolicy(prefill_chunk_tokens=512, arrival_hold_s=1.0)
    (long_request,) = _requests(4000)
    full = {id(long_request): 512}
    arrived = long_request.arrival_time
    # Within the hold after the latest arrival (the long prompt's own): 0.75 x 42 ms in all,
    # 21.5 ms of prompt work beside the 10 ms base.
    for now in (arrived, arrived + 0.9, arrived + 1.0):
        bounded = policy.bound(full, [long_request], 0, times, now, last_arrival=arrived)
        assert bounded == {id(long_request): 21}
    # Past the hold, a step may last as long as the quiet since it ended: 0.2 s -> 190 tokens;
    # 0.6 s -> the whole budget.
    grown = policy.bound(full, [long_request], 0, times, arrived + 1.2, arrived)
    assert grown[id(long_request)] == pytest.approx(190, abs=1)  # the clock's rounding
    assert policy.bound(full, [long_request], 0, times, arrived + 1.6, arrived) == full
    # Short prompts seen so far set the typical size: 8-token ones make the bound tighter, down
    # to the floor of the base's worth of prompt work (10 tokens).
    for _ in range(60):
        times.observe_short(8)
    assert times.snapshot()["short_prompt_tokens"] == pytest.approx(8.0, abs=0.01)
    assert policy.bound(full, [long_request], 0, times, arrived, arrived) == {id(long_request): 10}


def test_beside_decode_rows_a_long_prompt_banks_time_for_a_worthwhile_chunk() -> None:
    """At a long position a chunk of the few tokens a decode step leaves is mostly the cost of
    reading its context (3 ms per 1,000 positions here): the long prompt sits steps out and
    spends the banked time in one chunk whose tokens are at least half of it."""
    times = _times(0.020, 0.001, context_s=3e-6)
    policy = StepPolicy(prefill_chunk_tokens=512)
    (long_request,) = _requests(8000)
    long_request.num_computed_tokens = 6000  # its context: 18 ms to read per chunk
    credit, full = LongCredit(), {id(long_request): 512}
    now = long_request.arrival_time + 10.0
    plans = [policy.bound(full, [long_request], 4, times, now, credit=credit) for _ in range(4)]
    # 15 ms of prompt time per step: twice that is not yet worth a chunk, three times is.
    assert plans[:2] == [{}, {}]
    assert plans[2] == {id(long_request): times.tokens_within(0.045, 6000, 512)}
    tokens = plans[2][id(long_request)]
    assert times.prompt_seconds(tokens, 6000) >= 2 * times.chunk_overhead(tokens, 6000)
    assert plans[3] == {} and credit.skipped == 1  # banking again


def test_a_lone_long_prompt_keeps_its_speed_where_steps_are_mostly_fixed_cost() -> None:
    """A GPU-like device: a 15 ms launch-bound step, 30 us per prompt token. A short request's
    solo step is about the base, so the bound would leave a long prompt alone a few tokens per
    step; the floor of the base's worth of prompt work keeps its chunks near the budget."""
    times = _times(0.015, 0.00003)
    policy = StepPolicy(prefill_chunk_tokens=512, arrival_hold_s=1.0)
    (long_request,) = _requests(4000)
    arrived = long_request.arrival_time
    bounded = policy.bound({id(long_request): 512}, [long_request], 0, times, arrived, arrived)
    assert bounded == {id(long_request): 500}
    # At 6,000 positions the context read (18 ms) and the 10 ms base are matched by as much of
    # the prompt's own work (28 ms: 27 tokens). The floor counts the context read, not a chunk's
    # fitted fixed cost, which must not widen an arrival's wait: 40 ms of it leave
    # 0.75 x 82 ms - 10 ms - 40 ms = 11 tokens at position 0.
    times = _times(0.010, 0.001, context_s=3e-6)
    (deep_request,) = _requests(8000)
    deep_request.num_computed_tokens = 6000
    deep = policy.bound({id(deep_request): 512}, [deep_request], 0, times, arrived, arrived)
    assert (
        deep
        == {id(deep_request): times.tokens_within(0.010 + 0.036, 6000, 512)}
        == {id(deep_request): 27}
    )
    times = _times(0.010, 0.001, chunk_s=0.040)
    assert policy.bound({id(long_request): 512}, [long_request], 0, times, arrived, arrived) == {
        id(long_request): 11
    }


def test_an_arrival_during_a_long_only_step_waits_for_no_long_chunk() -> None:
    """The scheduler end to end, with a learned step-time model: a long prompt alone runs
    bounded steps while arrivals are likely; a short request that arrived while one ran is
    computed whole in the next step, beside only the floor of long work; once no arrival is
    likely, the long prompt takes the whole budget again."""
    sim = _sim(budget=512, short=64, blocks=4096)
    sim.scheduler.times = _times(0.010, 0.001)
    long_request = sim.add("long", 4000, num_outputs=1)
    assert chunk_summary(sim.step()) == [("long", 0, 21)]  # within the hold
    short_request = sim.add("short", 32, num_outputs=2)
    short_request.arrival_time -= 0.030  # it came 30 ms ago, while the step above ran
    sim.scheduler.last_arrival = short_request.arrival_time
    assert sorted(chunk_summary(sim.step())) == [("long", 21, MIN_CHUNK), ("short", 0, 32)]
    sim.step()  # the short request decodes its last token: a bounded step
    # Nothing sensitive and the hold over: the rest of the budget at once.
    sim.scheduler.last_arrival = long_request.arrival_time - 5.0
    start = long_request.num_computed_tokens
    assert chunk_summary(sim.step()) == [("long", start, 512)]


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


def test_the_step_model_is_visible_in_the_metrics(checkpoint: Path) -> None:
    """The fitted constants leave the engine: `/v1/metrics` "step_model", Prometheus gauges and
    the console's one-line view of them, all from one engine's real steps."""
    from dgpp.engine.server.metrics.prometheus import build_registry, render
    from dgpp.engine.server.metrics.service import ServiceMetrics
    from dgpp.engine.server.routes.metrics_routes import metrics_body
    from dgpp.webui.routes.overview_routes import step_model_view

    llm = LLM(str(checkpoint), kv_capacity=1024, block_size=4)
    unfitted = metrics_body(llm.engine.stats(), ServiceMetrics().counters())["step_model"]
    assert unfitted["decode_step_s"] is None and unfitted["solo_short_s"] is None
    assert step_model_view({"step_model": unfitted})["text"].startswith("not fitted yet")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm.generate([list(range(100, 180)), [5, 6, 7]], params)
    stats = llm.engine.stats()
    model = metrics_body(stats, ServiceMetrics().counters())["step_model"]
    terms = [model[key] for key in ("token_s", "token_position_s", "chunk_position_s", "chunk_s")]
    assert model["decode_step_s"] > 0 and min(terms) >= 0 and max(terms) > 0
    assert model["solo_short_s"] > model["decode_step_s"]
    assert model["short_prompt_tokens"] <= 32.0
    exposition = render(build_registry(ServiceMetrics(), lambda: "m", lambda: stats)).decode()
    for name in ("decode_step", "prompt_token", "solo_short"):
        assert f"dgpp:step_model_{name}_seconds{{" in exposition, name
    text = step_model_view({"step_model": model})["text"]
    assert text.startswith(f"decode step {model['decode_step_s'] * 1e3:.1f} ms, prompt token")
    assert "a short request alone" in text


def test_a_request_queued_during_a_step_arrives_when_it_was_queued(checkpoint: Path) -> None:
    """Through the server's engine thread: a request queued while a step runs counts its
    arrival (latency metrics, the policy's deadlines) from the moment it was queued, not from
    the end of that step."""
    import asyncio
    import threading
    import time

    from dgpp.engine.async_engine import AsyncEngine

    llm = LLM(str(checkpoint), kv_capacity=1024, block_size=4)
    stepping, release = threading.Event(), threading.Event()
    plain_step = llm.engine.step

    def held_step() -> list:
        stepping.set()
        release.wait(10)
        return plain_step()

    llm.engine.step = held_step  # type: ignore[method-assign]
    engine = AsyncEngine(llm.engine)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)

    async def scenario() -> tuple[float, float, float]:
        first = asyncio.create_task(_drain(engine.generate(list(range(100, 140)), params, "a")))
        await asyncio.to_thread(stepping.wait, 10)  # the engine thread is inside a step
        queued = time.monotonic()
        second = asyncio.create_task(_drain(engine.generate([5, 6, 7], params, "b")))
        await asyncio.sleep(0.3)
        step_ended = time.monotonic()
        release.set()
        await first
        arrival = (await second).arrival
        return queued, arrival, step_ended

    async def _drain(outputs):  # type: ignore[no-untyped-def]
        timings = None
        async for output in outputs:
            timings = output.timings
        return timings

    engine.start()
    try:
        queued, arrival, step_ended = asyncio.run(scenario())
    finally:
        engine.stop()
    assert queued <= arrival < queued + 0.1 < step_ended
