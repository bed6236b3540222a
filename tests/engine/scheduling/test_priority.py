"""Request priority in the scheduler (`dgpp.engine.scheduling.priority`), no model loaded:
admission and the prefill budget by rank, a better-ranked arrival displacing the worst running
request (for a concurrency slot, or for blocks), preemption taking the worst rank first, aging,
and a randomized mix of priorities that always finishes. The engine-level check (a displaced
request back through the host tier with its own tokens): tests/engine/test_priority_engine.py."""

from __future__ import annotations

import random

from dgpp.engine.sampling.sampling_params import SamplingParams
from dgpp.engine.scheduling.request import Request, RequestStatus
from dgpp.engine.scheduling.scheduler import StepPlan
from tests.engine.scheduling.test_scheduler import Simulation, ceil_div
from tests.engine.scheduling.test_step_policy import _times


class PrioritySimulation(Simulation):
    """`Simulation` with the plan's invariants where ranks differ: every chunk consistent with
    its request and table, every decode row kept unless preempted, the budget held, and no
    request preempted while one ranked worse got a chunk."""

    def _check_plan(
        self, plan: StepPlan, running_before: list[Request], pending_before: dict[int, int]
    ) -> None:
        scheduler, size = self.scheduler, self.blocks.block_size
        requests = [chunk.request for chunk in plan.chunks]
        assert len({id(r) for r in requests}) == len(requests), "a request scheduled twice"
        whole = [c for c in plan.chunks[plan.num_decodes :] if c.layers is None]
        assert sum(chunk.num_tokens for chunk in whole) <= scheduler.prefill_chunk_tokens
        for chunk in plan.chunks:
            assert chunk.start == chunk.request.num_computed_tokens
            assert chunk.request.status is RequestStatus.RUNNING
            assert len(chunk.request.block_table) == ceil_div(chunk.start + chunk.num_tokens, size)
        decoded = {id(chunk.request) for chunk in plan.chunks[: plan.num_decodes]}
        for request in running_before:
            if pending_before[id(request)] == 1 and request not in plan.preempted:
                assert id(request) in decoded, f"{request.request_id} lost its decode row"
        for request in plan.preempted:
            assert request.status is RequestStatus.WAITING and request.block_table == []
            assert all(r.rank <= request.rank for r in requests), "a better rank preempted"
        assert len(scheduler.running) <= scheduler.max_concurrency


def _add(
    sim: PrioritySimulation, request_id: str, prompt_len: int, outputs: int, priority: int
) -> Request:
    prompt = [1000 + len(sim.num_samples) * 7 + i for i in range(prompt_len)]
    request = Request(request_id, prompt, SamplingParams(priority=priority), max_tokens=outputs)
    sim.num_samples[request_id] = 0
    sim.scheduler.add(request)
    return request


def _first_chunk(sim: PrioritySimulation) -> list[str]:
    return [chunk.request.request_id for chunk in sim.step().chunks]


def test_admission_and_the_budget_go_by_priority() -> None:
    sim = PrioritySimulation(
        num_blocks=64, block_size=4, max_concurrency=1, prefill_chunk_tokens=16
    )
    _add(sim, "background", 8, 2, priority=10)
    _add(sim, "interactive", 8, 2, priority=0)
    assert _first_chunk(sim) == ["interactive"]  # the only slot, though it came second
    sim = PrioritySimulation(
        num_blocks=64, block_size=4, max_concurrency=4, prefill_chunk_tokens=16
    )
    _add(sim, "late", 40, 1, priority=5)
    _add(sim, "urgent", 40, 1, priority=-3)
    plan = sim.step()
    assert [(c.request.request_id, c.num_tokens) for c in plan.chunks] == [("urgent", 16)]


def test_a_better_arrival_displaces_the_worst_running_request() -> None:
    """Two slots held by background streams; an interactive request takes the newest one's
    slot in the step it arrives; the displaced one comes back and every request finishes."""
    sim = PrioritySimulation(
        num_blocks=64, block_size=4, max_concurrency=2, prefill_chunk_tokens=32
    )
    old = _add(sim, "old", 8, 6, priority=10)
    new = _add(sim, "new", 8, 6, priority=10)
    sim.step()
    sim.step()
    assert sim.scheduler.running == [old, new]
    interactive = _add(sim, "interactive", 8, 3, priority=0)
    plan = sim.step()
    assert plan.preempted == (new,) and new.status is RequestStatus.WAITING
    assert interactive in [chunk.request for chunk in plan.chunks]
    assert sim.scheduler.running == [interactive, old]  # rank order
    while sim.scheduler.has_unfinished:
        sim.step()
    assert sim.finished[0].request_id == "interactive"
    assert {r.request_id for r in sim.finished} == {"old", "new", "interactive"}
    # The same arrival at the same priority waits for a slot instead.
    sim = PrioritySimulation(
        num_blocks=64, block_size=4, max_concurrency=2, prefill_chunk_tokens=32
    )
    for name in ("a", "b"):
        _add(sim, name, 8, 6, priority=0)
    sim.step()
    _add(sim, "c", 8, 3, priority=0)
    assert not sim.step().preempted


def test_blocks_run_short_the_worst_rank_goes_first() -> None:
    """A pool too small for everyone: an urgent prompt needing blocks displaces the low-priority
    request holding them, not the normal one that arrived after it."""
    sim = PrioritySimulation(
        num_blocks=12, block_size=4, max_concurrency=8, prefill_chunk_tokens=64
    )
    low = _add(sim, "low", 16, 20, priority=9)
    normal = _add(sim, "normal", 12, 20, priority=0)
    sim.step()  # the normal prompt (the budget goes to the best rank's prompts)
    sim.step()  # then the low one's, beside the normal one's decode row
    assert sim.scheduler.running == [normal, low]
    urgent = _add(sim, "urgent", 20, 2, priority=-5)
    plan = sim.step()
    assert plan.preempted == (low,)
    assert normal in sim.scheduler.running and urgent in sim.scheduler.running
    while sim.scheduler.has_unfinished:
        sim.step()
    assert len(sim.finished) == 3


def test_a_waiting_request_ages_until_it_runs() -> None:
    """A priority-5 request behind a stream of priority-0 work, at one level per second
    waited: nothing moves it at first; once it has waited six seconds it ranks -1 and takes
    the slot."""
    sim = PrioritySimulation(
        num_blocks=64, block_size=4, max_concurrency=1, prefill_chunk_tokens=32
    )
    sim.scheduler.aging_s = 1.0
    _add(sim, "first", 8, 50, priority=0)
    sim.step()
    patient = _add(sim, "patient", 8, 2, priority=5)
    for _ in range(3):
        assert "patient" not in _first_chunk(sim)
    assert patient.rank == 5
    assert patient.progressed_at is not None
    patient.progressed_at -= 6.0
    assert "patient" in _first_chunk(sim)
    assert patient.rank == -1


def test_random_priorities_always_finish() -> None:
    """Arrivals of random priorities, sizes and pool pressure: every step keeps the plan's
    invariants (`Simulation`), the running rows stay in rank order, and everything finishes."""
    rng = random.Random(66)
    for trial in range(6):
        sim = PrioritySimulation(
            num_blocks=rng.randint(12, 40),
            block_size=4,
            max_concurrency=rng.randint(1, 5),
            prefill_chunk_tokens=rng.choice([8, 16, 32]),
        )
        sim.scheduler.aging_s = 0.0 if trial % 2 else 0.01
        count = 0
        for _ in range(400):
            if count < 24 and rng.random() < 0.3:
                _add(sim, f"r{count}", rng.randint(1, 36), rng.randint(1, 8), rng.randint(-2, 3))
                count += 1
            sim.step()
            ranks = [request.rank for request in sim.scheduler.running]
            assert ranks == sorted(ranks)
            if count == 24 and not sim.scheduler.has_unfinished:
                break
        assert len(sim.finished) == 24, f"trial {trial}: {len(sim.finished)} finished"


def test_background_decode_rows_do_not_bound_an_urgent_prompt() -> None:
    """The step-time bound keeps decode rows' inter-token latency by cutting long prompts'
    chunks (`step_policy`); rows all ranked below the best prompt are not what it protects: an
    urgent long prompt beside background streams takes whole chunks, while the same prompt
    beside streams of its own rank is cut."""
    for background, want in ((10, 64), (0, None)):
        sim = PrioritySimulation(
            num_blocks=256, block_size=4, max_concurrency=8, prefill_chunk_tokens=64
        )
        sim.scheduler.times = _times(0.020, 0.001)  # 20 ms decode steps, 1 ms a prompt token
        for index in range(3):
            _add(sim, f"stream-{index}", 8, 40, priority=background)
        for _ in range(3):
            sim.step()  # prompts done: the streams decode
        urgent = _add(sim, "urgent", 400, 1, priority=0)
        sim.scheduler.last_arrival = urgent.arrival_time - 60.0  # no arrival to wait for
        plan = sim.step()
        (chunk,) = [c for c in plan.chunks if c.request is urgent]
        if want is None:
            assert chunk.num_tokens < 64 or chunk.layers is not None, chunk
        else:
            assert (chunk.num_tokens, chunk.layers) == (want, None), chunk
