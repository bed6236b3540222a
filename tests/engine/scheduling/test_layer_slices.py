"""Layer slices (`dgpp.engine.scheduling.layer_slices`): a long prompt's chunk computed a few layers
per step. The policy sizes slices from the step-time model (a bounded step at any position, the
chunk kept large), the scheduler carries a chunk in flight across steps (its tokens counted
once its last layer is done, a preempted one recomputed), and greedy outputs equal unsliced
ones token for token (tiny random-weight model, float32: with decode rows, short prompts, the
prefix cache, preemption and an abort in the middle of a chunk)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import pytest

from dgpp.engine import LLM, SamplingParams
from dgpp.engine.scheduling.layer_slices import slice_seconds
from dgpp.engine.scheduling.request import Request
from dgpp.engine.scheduling.step_policy import (
    ARRIVAL_WAIT,
    MAX_SKIPS,
    STRETCH,
    LongCredit,
    StepPolicy,
)
from dgpp.engine.scheduling.step_times import StepTimes
from tests.conftest import build_tiny_checkpoint
from tests.engine.scheduling.test_scheduler import Simulation
from tests.engine.scheduling.test_step_policy import _requests, _times

LAYERS = 30


def test_a_long_only_step_is_a_slice_of_a_large_chunk_at_any_position() -> None:
    """10 ms base, 1 ms a token and 3 us a token per earlier position (a CPU-like device where
    a chunk deep in a long prompt is costly): a typical short request's solo step is 42 ms, so
    a long-only step may last 0.75 x 42 ms. Token-bounded, that is 5 tokens at position 6,000;
    sliced, one layer of a chunk of 50 tokens."""
    times = _times(0.010, 0.001, slope_s=3e-6)
    policy = StepPolicy(prefill_chunk_tokens=512, num_layers=LAYERS)
    (long_request,) = _requests(8000)
    long_request.num_computed_tokens = 6000
    wait = ARRIVAL_WAIT * times.solo_short_s()
    slices: dict[int, int] = {}
    now = long_request.arrival_time
    bounded = policy.bound(
        {id(long_request): 512}, [long_request], 0, times, now, now, None, slices
    )
    tokens, layers = bounded[id(long_request)], slices[id(long_request)]
    # The chunk one layer of which fits the step, and that one layer first.
    assert slice_seconds(times, tokens, 6000, 1, LAYERS) <= wait
    assert slice_seconds(times, tokens + 1, 6000, 1, LAYERS) > wait
    assert layers == 1
    plain = times.tokens_within(wait - times.decode_step_s, 6000, 512)
    assert tokens >= 5 * plain  # the chunk a plain bounded step could hold is far smaller
    # Early in the prompt the same bound holds a slice of the whole budget: 512 tokens from
    # position 0 take 905 ms beside the 10 ms base, one layer of them 31 ms.
    (fresh,) = _requests(8000)
    slices.clear()
    bounded = policy.bound({id(fresh): 512}, [fresh], 0, times, now, now, None, slices)
    assert bounded == {id(fresh): 512} and slices[id(fresh)] == 1
    assert slice_seconds(times, 512, 0, 1, LAYERS) == pytest.approx(0.0305, abs=1e-4)
    # Unsliced models (num_layers 0) keep token-bounded chunks.
    unsliced: dict[int, int] = {}
    plain_policy = dataclasses.replace(policy, num_layers=0)
    assert plain_policy.bound({id(fresh): 512}, [fresh], 0, times, now, now, None, unsliced)
    assert unsliced == {}


def test_a_chunk_in_flight_goes_on_with_the_layers_that_fit() -> None:
    times = _times(0.010, 0.001)
    policy = StepPolicy(prefill_chunk_tokens=512, num_layers=LAYERS)
    (long_request,) = _requests(4000)
    long_request.slice_tokens, long_request.slice_layers = 300, 28  # two layers left
    now = long_request.arrival_time + 10.0
    slices: dict[int, int] = {}
    # Whatever the share says now (64 tokens), the chunk keeps its 300 tokens; a long-only step
    # holds 3 of its layers, but only 2 are left.
    bounded = policy.bound({id(long_request): 64}, [long_request], 0, times, now, now, None, slices)
    assert bounded == {id(long_request): 300} and slices == {id(long_request): 2}
    # Once its slices measured a layer (here 30 ms, where the model says 10.4), that decides.
    long_request.slice_layers, long_request.slice_layer_s = 10, 0.030
    slices.clear()
    policy.bound({id(long_request): 64}, [long_request], 0, times, now, now, None, slices)
    assert slices == {id(long_request): 1}


def test_beside_decode_rows_a_slice_waits_for_the_banked_time_of_one_layer() -> None:
    """Decode rows leave 0.75 x 20 ms a step; one layer of the chunk in flight costs 24 ms: the
    long prompt sits one step out, then runs one layer on the time it banked."""
    times = _times(0.020, 0.001, slope_s=3e-6)
    policy = StepPolicy(prefill_chunk_tokens=512, num_layers=LAYERS)
    (long_request,) = _requests(8000)
    long_request.num_computed_tokens = 6000
    long_request.slice_tokens, long_request.slice_layers = 40, 3
    per_layer = slice_seconds(times, 40, 6000, 1, LAYERS)
    spare = (STRETCH - 1) * 0.020
    assert spare < per_layer < 2 * spare
    credit, now = LongCredit(), long_request.arrival_time + 10.0
    plans = []
    for _ in range(3):
        slices: dict[int, int] = {}
        bounded = policy.bound(
            {id(long_request): 128}, [long_request], 4, times, now, None, credit, slices
        )
        plans.append((bounded, slices))
    assert plans[0] == ({}, {})  # banked
    assert plans[1] == ({id(long_request): 40}, {id(long_request): 1})  # spent
    assert plans[2] == ({}, {}) and credit.skipped == 1  # banking again


def test_the_step_model_learns_from_slices_as_from_whole_chunks() -> None:
    """A slice alone costs its share of a whole step of its chunk (the base's weight read
    included): fitted from slices only, the model predicts whole chunks."""
    sliced = StepTimes()
    for index in range(60):
        sliced.observe(0.020, num_decodes=4, prompt_chunks=[])
        start, n, layers = 512 * (index % 8), (16, 64, 512)[index % 3], 1 + index % 5
        share = layers / LAYERS
        cost = 0.020 + n * (0.001 + 1e-7 * (start + n / 2))
        sliced.observe(share * cost, 0, [], (start, n, share))
    a, b, _, _ = sliced.terms()
    assert a == pytest.approx(0.001, rel=1e-3) and b == pytest.approx(1e-7, rel=1e-3)
    assert slice_seconds(sliced, 100, 1000, 3, LAYERS) == pytest.approx(
        0.1 * (0.020 + 100 * (0.001 + 1e-7 * 1050)), rel=1e-3
    )


def test_the_scheduler_counts_a_sliced_chunk_once_its_last_layer_is_done() -> None:
    """The scheduler end to end: a long prompt alone goes in slices; an arrival is computed
    whole in the next step beside the slice; the chunk's tokens count after its last layer;
    preemption drops the chunk in flight (recomputed from its first layer)."""
    sim = Simulation(num_blocks=4096, block_size=4, prefill_chunk_tokens=512)
    sim.scheduler.policy = StepPolicy(512, short_prompt_tokens=64, num_layers=LAYERS)
    sim.scheduler.times = _times(0.010, 0.001)
    long_request = sim.add("long", 4000, num_outputs=1)
    plan = sim.step()
    (chunk,) = plan.chunks
    # 0.75 x 42 ms a step; a layer of the 512-token chunk is 17 ms.
    assert (chunk.start, chunk.num_tokens, chunk.layers) == (0, 512, (0, 1, LAYERS))
    assert long_request.num_computed_tokens == 0  # nothing counts before the last layer
    assert (long_request.slice_tokens, long_request.slice_layers) == (512, 1)
    short_request = sim.add("short", 32, num_outputs=2)
    plan = sim.step()
    summary = sorted((c.request.request_id, c.start, c.num_tokens, c.layers) for c in plan.chunks)
    assert summary[1] == ("short", 0, 32, None)  # the arrival whole, the slice beside it
    assert summary[0][:3] == ("long", 0, 512) and summary[0][3][0] == 1
    assert plan.chunks[-1].request is long_request  # a slice runs after the whole rows
    while long_request.num_computed_tokens == 0:
        plan = sim.step()
    assert long_request.num_computed_tokens == 512 and long_request.slice_layers == 0
    assert any(c.layers is not None and c.completes for c in plan.chunks)
    assert short_request.num_output_tokens >= 1
    sim.step()  # the next chunk in flight
    assert long_request.slice_layers > 0
    sim.scheduler._preempt(long_request)
    assert (long_request.slice_tokens, long_request.slice_layers) == (0, 0)
    while long_request in sim.scheduler.requests.values():
        sim.step()
    assert sim.num_samples["long"] == 1


def test_with_no_step_bound_a_chunk_in_flight_finishes_in_one_step() -> None:
    sim = Simulation(num_blocks=4096, block_size=4, prefill_chunk_tokens=512)
    sim.scheduler.policy = StepPolicy(512, 64, step_target_ms=-1.0, num_layers=LAYERS)
    long_request = sim.add("long", 4000, num_outputs=1)
    long_request.slice_tokens, long_request.slice_layers = 0, 0
    sim.step()
    long_request.slice_tokens, long_request.slice_layers = 100, 7  # as a retuned policy finds
    long_request.num_computed_tokens = 512
    plan = sim.scheduler.schedule()
    assert [(c.num_tokens, c.layers) for c in plan.chunks] == [(100, (7, LAYERS, LAYERS))]


@dataclasses.dataclass(frozen=True)
class SliceEveryLongChunk(StepPolicy):
    """A test policy: every long prompt's chunk goes `per_step` layers a step, whatever the
    timings (so a run is sliced however fast this machine is)."""

    per_step: int = 1

    def bound(  # type: ignore[override]
        self,
        amounts: dict[int, int],
        prompts: Sequence[Request],
        num_decodes: int,
        times: StepTimes,
        now: float,
        last_arrival: float | None = None,
        credit: LongCredit | None = None,
        slices: dict[int, int] | None = None,
    ) -> dict[int, int]:
        for request in prompts:
            if id(request) in amounts and not self.is_short(request) and slices is not None:
                slices[id(request)] = self.per_step
        return amounts


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return build_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny"), tokenizer_dir, "LlamaForCausalLM", num_hidden_layers=3
    )


def _sliced(llm: LLM, per_step: int) -> None:
    scheduler = llm.engine.scheduler
    layers = llm.engine.runner.model.num_slice_layers
    assert layers == 3
    policy = scheduler.policy
    scheduler.policy = SliceEveryLongChunk(
        policy.prefill_chunk_tokens,
        policy.short_prompt_tokens,
        num_layers=layers,
        per_step=per_step,
    )


@pytest.mark.parametrize("per_step", [1, 2])
def test_greedy_outputs_do_not_change_with_layer_slices(checkpoint: Path, per_step: int) -> None:
    shared = list(range(400, 440))  # a common prefix: the prefix cache serves later requests
    prompts = [shared + list(range(600, 700)), [5, 6, 7], shared + [9, 9, 9], list(range(50, 90))]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    knobs = {"block_size": 4, "prefix_min_tokens": 8, "prefill_chunk_tokens": 16}
    plain = LLM(str(checkpoint), kv_capacity=1024, step_target_ms=-1.0, **knobs)
    alone = [list(plain.generate([p], params)[0].outputs[0].token_ids) for p in prompts]
    # A small pool: requests are preempted, some with a chunk in flight.
    llm = LLM(str(checkpoint), kv_capacity=160, short_prompt_tokens=8, **knobs)
    _sliced(llm, per_step)
    together = llm.generate(prompts, params)
    assert [list(o.outputs[0].token_ids) for o in together] == alone
    engine = llm.engine
    assert engine.counters.num_layer_slices > 0 and engine.scheduler.num_preemptions > 0
    assert engine.block_manager.num_used_blocks == 0 and not engine.runner.streams


def test_an_abort_in_the_middle_of_a_sliced_chunk_drops_its_stream(checkpoint: Path) -> None:
    llm = LLM(
        str(checkpoint),
        kv_capacity=1024,
        block_size=4,
        prefill_chunk_tokens=16,
        short_prompt_tokens=8,
    )
    _sliced(llm, per_step=1)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    doomed = engine.add_request(list(range(100, 200)), params).request_id
    engine.step()
    request = engine.scheduler.requests[doomed]
    assert request.slice_layers == 1 and request.seq_id in engine.runner.streams
    engine.abort(doomed)
    survivor = engine.add_request(list(range(300, 340)), params).request_id
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for output in engine.step():
            tokens[output.request_id] = list(output.outputs[0].token_ids)
    assert not engine.runner.streams
    fresh = LLM(str(checkpoint), kv_capacity=1024, block_size=4, step_target_ms=-1.0)
    expected = fresh.generate([list(range(300, 340))], params)[0].outputs[0].token_ids
    assert tokens[survivor] == list(expected)


def _sliced_rank(*args: object) -> None:
    """A rank of `_check_world_of_two` whose rank 0 slices every long chunk a layer a step."""
    from tests.engine.distributed.test_tensor_parallel import _rank

    plain = StepPolicy.of

    def sliced(config: object, model: object) -> StepPolicy:
        policy = plain(config, model)  # type: ignore[arg-type]
        layers = model.num_slice_layers  # type: ignore[attr-defined]
        return SliceEveryLongChunk(
            policy.prefill_chunk_tokens, policy.short_prompt_tokens, num_layers=layers
        )

    StepPolicy.of = sliced  # type: ignore[method-assign,assignment] (this rank's process only)
    _rank(*args)  # type: ignore[arg-type]


def test_world_of_two_equals_world_of_one_through_layer_slices(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    """Every rank keeps its own residual stream between slices; the step messages carry each
    slice's layers, and world 2's tokens are world 1's."""
    from tests.engine.distributed import test_tensor_parallel as tp

    checkpoint = build_tiny_checkpoint(tmp_path, tokenizer_dir, "Qwen2ForCausalLM")
    tp._check_world_of_two(checkpoint, tp.INTERACTIVE, target=_sliced_rank, sliced=True)


def _family(name: str) -> tuple[str, dict[str, object]]:
    from tests.engine.models.test_deepseek_v3 import MOE
    from tests.engine.models.test_moe_parity import FAMILIES
    from tests.engine.models.test_sparse_attention import SHARED

    return {
        "qwen3-moe": FAMILIES["qwen3-moe"],
        "glm4-moe": FAMILIES["glm4-moe"],
        "gpt-oss": FAMILIES["gpt-oss"],
        "deepseek-v3-moe": ("DeepseekV3ForCausalLM", MOE),
        "deepseek-v3.2": ("DeepseekV32ForCausalLM", {}),
        "glm-5-shared": ("GlmMoeDsaForCausalLM", SHARED),
        "qwen3-next": ("Qwen3NextForCausalLM", {"mlp_only_layers": [1]}),
        "qwen4-exp": ("Qwen4ExpForCausalLM", {}),
    }[name]


@pytest.mark.parametrize(
    ("family", "sliced"),
    [
        ("qwen3-moe", True),
        ("glm4-moe", True),
        ("gpt-oss", True),  # sliding-window layers and attention sinks
        ("deepseek-v3-moe", True),  # MLA latents
        ("deepseek-v3.2", True),  # sparse attention, an indexer in every layer
        ("glm-5-shared", False),  # shared-indexer layers reuse a selection made in the forward
        ("qwen3-next", False),  # recurrent states
        ("qwen4-exp", False),  # hyper-connection streams
    ],
)
def test_every_family_slices_exactly_or_not_at_all(
    tmp_path: Path, tokenizer_dir: Path, family: str, sliced: bool
) -> None:
    architecture, overrides = _family(family)
    checkpoint = build_tiny_checkpoint(tmp_path, tokenizer_dir, architecture, **overrides)
    knobs = {"block_size": 4, "prefill_chunk_tokens": 16, "kv_capacity": 1024}
    llm = LLM(str(checkpoint), short_prompt_tokens=8, **knobs)
    layers = llm.engine.runner.model.num_slice_layers
    assert (layers > 0) == sliced
    assert llm.engine.scheduler.policy.num_layers == layers
    if not sliced:
        return
    prompts = [list(range(300, 345)), [5, 6, 7], list(range(1000, 1030))]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    plain = LLM(str(checkpoint), step_target_ms=-1.0, **knobs).generate(prompts, params)
    scheduler = llm.engine.scheduler
    scheduler.policy = SliceEveryLongChunk(16, 8, num_layers=layers, per_step=2)
    together = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in plain]
    assert llm.engine.counters.num_layer_slices > 0


def test_a_chunk_started_beside_decode_rows_fits_a_layer_in_every_step() -> None:
    """Beside decode rows a new chunk is sized so one of its layers fits what they leave (0.75 x
    20 ms): every step carries a layer and inter-token latency stays even."""
    times = _times(0.020, 0.001, slope_s=3e-6)
    policy = StepPolicy(prefill_chunk_tokens=512, num_layers=LAYERS)
    (long_request,) = _requests(8000)
    long_request.num_computed_tokens = 6000
    credit, now = LongCredit(), long_request.arrival_time + 10.0
    slices: dict[int, int] = {}
    bounded = policy.bound(
        {id(long_request): 512}, [long_request], 4, times, now, None, credit, slices
    )
    tokens = bounded[id(long_request)]
    assert slices == {id(long_request): 1}
    spare = (STRETCH - 1) * 0.020
    assert slice_seconds(times, tokens, 6000, 1, LAYERS) <= spare
    assert slice_seconds(times, tokens + 1, 6000, 1, LAYERS) > spare
    assert tokens > 4 * times.tokens_within(spare, 6000, 512)


def test_a_chunk_in_flight_is_timed_by_the_steps_that_held_it_alone() -> None:
    sim = Simulation(num_blocks=4096, block_size=4, prefill_chunk_tokens=512)
    sim.scheduler.policy = StepPolicy(512, short_prompt_tokens=64, num_layers=LAYERS)
    sim.scheduler.times = _times(0.010, 0.001)
    long_request = sim.add("long", 4000, num_outputs=1)
    plan = sim.step()
    sim.scheduler.observe(plan, 0.042)  # one layer alone: 42 ms, where the model said 17
    assert long_request.slice_layer_s == pytest.approx(0.042)
    # A short arrival: a 42-ms layer does not fit beside it (0.75 x its 42-ms solo step, less
    # the step's base), so the chunk sits the step out.
    sim.add("short", 32, num_outputs=40)
    plan = sim.step()
    assert [c.request.request_id for c in plan.chunks] == ["short"]
    for _ in range(MAX_SKIPS + 1):  # its decode rows; the slice once its layer's time is banked
        plan = sim.step()
        if len(plan.chunks) == 2:
            break
    assert len(plan.chunks) == 2 and plan.chunks[1].layers is not None
    sim.scheduler.observe(plan, 0.001)  # beside other rows: not a measurement of the slice
    assert long_request.slice_layer_s == pytest.approx(0.042)
