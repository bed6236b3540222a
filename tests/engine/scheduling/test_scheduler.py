"""The continuous-batching scheduler on its own: plan layout, the prefill budget, chunking,
concurrency, FIFO admission, preemption and a randomized no-deadlock simulation.

No model is loaded. `Simulation` drives the scheduler as `LLMEngine.step` does: every chunk's
tokens become computed, every sampling chunk appends one (fake) token, and a request finishes
through `Scheduler.finish` once it has `max_tokens` outputs.
"""

from __future__ import annotations

import random

import pytest

from dgpp.engine.cache.block_manager import BlockManager
from dgpp.engine.sampling.sampling_params import SamplingParams
from dgpp.engine.scheduling.request import Request, RequestStatus
from dgpp.engine.scheduling.scheduler import Scheduler, StepPlan

PARAMS = SamplingParams()
FAKE_TOKEN = 7


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class Simulation:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_concurrency: int = 64,
        prefill_chunk_tokens: int = 16,
    ) -> None:
        self.blocks = BlockManager(num_blocks, block_size)
        self.scheduler = Scheduler(self.blocks, max_concurrency, prefill_chunk_tokens)
        self.finished: list[Request] = []
        self.num_samples: dict[str, int] = {}
        self.num_steps = 0
        # `ScheduledChunk.is_sampling` reads the request live, so it is recorded before the step
        # appends tokens: one flag per chunk of the last plan.
        self.last_sampling: list[bool] = []

    def add(self, request_id: str, prompt_len: int, num_outputs: int) -> Request:
        """Queue a request that finishes after `num_outputs` sampled tokens."""
        prompt = [1000 + len(self.num_samples) * 7 + i for i in range(prompt_len)]
        request = Request(request_id, prompt, PARAMS, max_tokens=num_outputs)
        self.num_samples[request_id] = 0
        self.scheduler.add(request)
        return request

    def step(self) -> StepPlan:
        scheduler = self.scheduler
        running_before = list(scheduler.running)
        pending_before = {id(r): r.num_pending_tokens for r in running_before}
        plan = scheduler.schedule()
        self._check_plan(plan, running_before, pending_before)
        self.last_sampling = [chunk.is_sampling for chunk in plan.chunks]
        sampling = [chunk.request for chunk in plan.chunks if chunk.is_sampling]
        for chunk in plan.chunks:
            request = chunk.request
            # As the output processor takes in a layer slice.
            if chunk.layers is not None and request.take_slice(chunk.num_tokens, *chunk.layers[1:]):
                continue
            request.num_computed_tokens += chunk.num_tokens
        for request in sampling:
            request.token_ids.append(FAKE_TOKEN)
            self.num_samples[request.request_id] += 1
            if request.num_output_tokens >= request.max_tokens:
                scheduler.finish(request)
                self.finished.append(request)
        self.num_steps += 1
        self._check_blocks()
        return plan

    def _check_plan(
        self, plan: StepPlan, running_before: list[Request], pending_before: dict[int, int]
    ) -> None:
        scheduler = self.scheduler
        requests = [chunk.request for chunk in plan.chunks]
        assert len({id(r) for r in requests}) == len(requests), "a request scheduled twice"
        decodes = plan.chunks[: plan.num_decodes]
        prefills = plan.chunks[plan.num_decodes :]
        for chunk in decodes:
            assert chunk.num_tokens == 1 and chunk.is_sampling
        # The budget holds for each forward: the step's whole chunks, and a layer slice apart.
        whole = [chunk for chunk in prefills if chunk.layers is None]
        assert sum(chunk.num_tokens for chunk in whole) <= scheduler.prefill_chunk_tokens
        assert len(whole) >= len(prefills) - 1, "one layer slice a step at most"
        for chunk in plan.chunks:
            request = chunk.request
            assert chunk.num_tokens >= 1
            assert chunk.start == request.num_computed_tokens
            assert chunk.start + chunk.num_tokens <= request.num_tokens
            assert request in scheduler.running and request.status is RequestStatus.RUNNING
            # The table holds exactly the blocks the computed tokens plus this chunk need.
            block_size = self.blocks.block_size
            assert len(request.block_table) == ceil_div(chunk.start + chunk.num_tokens, block_size)
        # Decode rows always run (unless their request was preempted).
        decode_ids = {id(chunk.request) for chunk in decodes}
        for request in running_before:
            if pending_before[id(request)] == 1 and request not in plan.preempted:
                assert id(request) in decode_ids, f"{request.request_id} lost its decode row"
        # The oldest running request always progresses, unless it sits the step out to bank
        # its time (at most MAX_SKIPS steps in a row).
        credit = scheduler.credit
        if running_before and not (credit.owner == id(running_before[0]) and credit.skipped):
            assert running_before[0] in requests
        # Preemption takes the newest running requests and queues them first, in running order.
        if plan.preempted:
            count = len(plan.preempted)
            assert set(map(id, plan.preempted)) == set(map(id, running_before[-count:]))
            assert list(scheduler.waiting)[:count] == list(reversed(plan.preempted))
            assert all(r in running_before for r in requests), "admitted despite preemption"
            for request in plan.preempted:
                assert request.status is RequestStatus.WAITING
                assert request.block_table == [] and request.num_computed_tokens == 0
                assert request not in scheduler.running
        assert len(scheduler.running) <= scheduler.max_concurrency

    def _check_blocks(self) -> None:
        running_blocks = [b for r in self.scheduler.running for b in r.block_table]
        assert len(running_blocks) == len(set(running_blocks)), "a block shared by two tables"
        assert len(running_blocks) == self.blocks.num_used_blocks
        for request in self.scheduler.waiting:
            assert request.block_table == [] and request.num_computed_tokens == 0
        for request in self.finished:
            assert request.block_table == [] and request.status is RequestStatus.FINISHED


def chunk_summary(plan: StepPlan) -> list[tuple[str, int, int]]:
    return [(c.request.request_id, c.start, c.num_tokens) for c in plan.chunks]


def test_decode_rows_come_first() -> None:
    sim = Simulation(num_blocks=64, block_size=4, prefill_chunk_tokens=8)
    sim.add("a", 3, num_outputs=10)
    sim.add("c", 2, num_outputs=10)
    first = sim.step()  # both short prompts prefilled in one step, each samples
    assert chunk_summary(first) == [("a", 0, 3), ("c", 0, 2)]
    assert first.num_decodes == 0 and first.has_prefill
    assert sim.last_sampling == [True, True]
    sim.add("b", 20, num_outputs=10)
    second = sim.step()
    assert chunk_summary(second) == [("a", 3, 1), ("c", 2, 1), ("b", 0, 8)]
    assert second.num_decodes == 2
    assert second.num_tokens == 10
    assert sim.last_sampling == [True, True, False]


def test_single_token_prompt_is_a_decode_row_ahead_of_prefills() -> None:
    sim = Simulation(num_blocks=64, block_size=4, prefill_chunk_tokens=16)
    sim.add("long", 6, num_outputs=4)
    sim.add("one", 1, num_outputs=4)
    plan = sim.step()
    assert chunk_summary(plan) == [("one", 0, 1), ("long", 0, 6)]
    assert plan.num_decodes == 1


def test_long_prompt_is_chunked_while_decodes_keep_running() -> None:
    sim = Simulation(num_blocks=64, block_size=4, prefill_chunk_tokens=8)
    sim.add("short", 3, num_outputs=50)
    sim.step()
    sim.add("long", 50, num_outputs=3)
    starts, sizes, sampling = [], [], []
    for _ in range(7):
        plan = sim.step()
        assert plan.num_decodes == 1 and plan.chunks[0].request.request_id == "short"
        (chunk,) = plan.chunks[1:]
        assert chunk.request.request_id == "long"
        starts.append(chunk.start)
        sizes.append(chunk.num_tokens)
        sampling.append(sim.last_sampling[1])
    assert starts == [0, 8, 16, 24, 32, 40, 48]
    assert sizes == [8, 8, 8, 8, 8, 8, 2]
    assert sampling == [False] * 6 + [True]
    plan = sim.step()  # both decode now
    assert plan.num_decodes == 2 and not plan.has_prefill


def test_prefill_budget_is_shared_in_arrival_order() -> None:
    sim = Simulation(num_blocks=64, block_size=4, prefill_chunk_tokens=8)
    sim.add("a", 10, num_outputs=5)
    sim.add("b", 10, num_outputs=5)
    assert chunk_summary(sim.step()) == [("a", 0, 8)]  # the budget is spent; b waits
    assert [r.request_id for r in sim.scheduler.waiting] == ["b"]
    assert chunk_summary(sim.step()) == [("a", 8, 2), ("b", 0, 6)]
    plan = sim.step()
    assert chunk_summary(plan) == [("a", 10, 1), ("b", 6, 4)]
    assert plan.num_decodes == 1


def test_prefill_budget_never_exceeded_and_decodes_always_run() -> None:
    sim = Simulation(num_blocks=256, block_size=4, max_concurrency=16, prefill_chunk_tokens=5)
    rng = random.Random(3)
    for index in range(12):
        sim.add(f"r{index}", rng.randint(1, 30), num_outputs=rng.randint(1, 12))
    saw_mixed_step = False
    while sim.scheduler.has_unfinished:
        plan = sim.step()  # the budget and decode-row checks run inside
        prefill_tokens = plan.num_tokens - plan.num_decodes
        assert prefill_tokens <= 5
        saw_mixed_step |= plan.num_decodes > 0 and plan.has_prefill
        assert sim.num_steps < 500
    assert saw_mixed_step
    assert len(sim.finished) == 12


def test_max_concurrency_is_respected_and_admission_is_fifo() -> None:
    sim = Simulation(num_blocks=256, block_size=4, max_concurrency=2, prefill_chunk_tokens=64)
    outputs = {"r0": 3, "r1": 6, "r2": 2, "r3": 4, "r4": 1}
    for request_id, count in outputs.items():
        sim.add(request_id, 5, num_outputs=count)
    first_scheduled: dict[str, int] = {}
    while sim.scheduler.has_unfinished:
        plan = sim.step()
        assert len(sim.scheduler.running) <= 2
        assert len(plan.chunks) <= 2
        for chunk in plan.chunks:
            first_scheduled.setdefault(chunk.request.request_id, sim.num_steps)
    order = sorted(first_scheduled, key=lambda rid: (first_scheduled[rid], rid))
    assert order == ["r0", "r1", "r2", "r3", "r4"]
    assert first_scheduled["r2"] > first_scheduled["r1"]  # r2 had to wait for a free slot
    assert sorted(r.request_id for r in sim.finished) == sorted(outputs)
    assert [sim.num_samples[rid] for rid in outputs] == list(outputs.values())
    assert sim.blocks.num_used_blocks == 0


def test_head_of_line_request_waiting_for_blocks_is_not_overtaken() -> None:
    sim = Simulation(num_blocks=4, block_size=4, prefill_chunk_tokens=16)
    sim.add("a", 7, num_outputs=2)  # 2 blocks
    sim.step()
    big = sim.add("big", 12, num_outputs=4)  # needs 3 blocks; only 2 are free
    small = sim.add("small", 2, num_outputs=1)  # would fit, but arrived later
    plan = sim.step()
    assert chunk_summary(plan) == [("a", 7, 1)]
    assert list(sim.scheduler.waiting) == [big, small]
    assert sim.finished[-1].request_id == "a"
    plan = sim.step()  # a finished, so big is admitted first
    assert chunk_summary(plan)[0] == ("big", 0, 12)


def test_newest_request_is_preempted_when_the_pool_is_full() -> None:
    sim = Simulation(num_blocks=4, block_size=4, max_concurrency=2, prefill_chunk_tokens=16)
    a = sim.add("a", 6, num_outputs=8)
    b = sim.add("b", 6, num_outputs=5)
    c = sim.add("c", 2, num_outputs=2)  # waits behind a and b (max_concurrency=2)
    assert chunk_summary(sim.step()) == [("a", 0, 6), ("b", 0, 6)]
    assert sim.blocks.num_free_blocks == 0
    for _ in range(2):  # tokens 7 and 8 still fit the two blocks each holds
        plan = sim.step()
        assert plan.num_decodes == 2 and not plan.preempted
    assert b.num_output_tokens == 3
    b_tokens = list(b.token_ids)
    plan = sim.step()  # a's 9th token needs a third block: b must give its blocks up
    assert plan.preempted == (b,)
    assert chunk_summary(plan) == [("a", 8, 1)]
    assert sim.scheduler.running == [a]
    assert list(sim.scheduler.waiting) == [b, c]  # b goes to the front, ahead of c
    assert b.status is RequestStatus.WAITING
    assert b.block_table == [] and b.num_computed_tokens == 0
    assert b.token_ids == b_tokens  # generated tokens are kept, to be recomputed
    assert b.num_preemptions == 1 and sim.scheduler.num_preemptions == 1
    assert len(a.block_table) == 3
    # a keeps decoding; b (9 tokens to recompute, 3 blocks) waits until a is done.
    while not a.is_finished:
        plan = sim.step()
        assert plan.chunks[0].request is a
        assert list(sim.scheduler.waiting)[:1] == [b]
    plan = sim.step()
    assert chunk_summary(plan)[0] == ("b", 0, 9)
    assert sim.last_sampling[0]  # the recompute reaches the end: b samples its 4th token
    while sim.scheduler.has_unfinished:
        sim.step()
        assert sim.num_steps < 100
    assert [r.request_id for r in sim.finished] == ["a", "b", "c"]
    assert sim.num_samples == {"a": 8, "b": 5, "c": 2}
    assert sim.blocks.num_used_blocks == 0


def test_preemption_frees_several_newest_requests_in_order() -> None:
    sim = Simulation(num_blocks=6, block_size=2, prefill_chunk_tokens=32)
    a = sim.add("a", 4, num_outputs=6)  # 2 blocks
    b = sim.add("b", 4, num_outputs=6)  # 2 blocks
    c = sim.add("c", 3, num_outputs=6)  # 2 blocks
    sim.step()
    assert sim.blocks.num_free_blocks == 0
    # a: 5 tokens, 4 computed -> its decode needs a third block; c (newest) goes first.
    plan = sim.step()
    assert plan.preempted == (c,)
    assert [chunk.request for chunk in plan.chunks] == [a, b]
    plan = sim.step()  # c's freed blocks: a took one, b took the other; nothing left
    assert not plan.preempted
    plan = sim.step()  # a and b both need a fourth block; b is preempted for a
    assert plan.preempted == (b,)
    assert list(sim.scheduler.waiting) == [b, c]
    while sim.scheduler.has_unfinished:
        sim.step()
        assert sim.num_steps < 200
    assert sim.num_samples == {"a": 6, "b": 6, "c": 6}
    assert sim.blocks.num_used_blocks == 0


def test_finish_of_a_waiting_request_removes_it() -> None:
    sim = Simulation(num_blocks=16, block_size=4, max_concurrency=1)
    running = sim.add("running", 3, num_outputs=5)
    queued = sim.add("queued", 3, num_outputs=5)
    sim.step()
    assert list(sim.scheduler.waiting) == [queued]
    sim.scheduler.finish(queued)
    assert not sim.scheduler.waiting
    assert queued.status is RequestStatus.FINISHED
    assert sim.scheduler.has_unfinished  # `running` is still there
    sim.scheduler.finish(running)  # an abort mid-flight returns its blocks
    assert not sim.scheduler.has_unfinished
    assert sim.blocks.num_used_blocks == 0
    assert sim.scheduler.schedule().is_empty


def test_finish_of_a_request_mid_prefill_frees_its_blocks() -> None:
    sim = Simulation(num_blocks=16, block_size=4, prefill_chunk_tokens=8)
    request = sim.add("long", 30, num_outputs=2)
    sim.step()
    assert sim.blocks.num_used_blocks == 2
    sim.scheduler.finish(request)
    assert sim.blocks.num_used_blocks == 0
    assert request.block_table == [] and not sim.scheduler.running


POOLS = [(3, 4), (4, 4), (6, 2), (8, 4), (16, 8), (40, 16)]  # (num_blocks, block_size)


@pytest.mark.parametrize(("num_blocks", "block_size"), POOLS)
def test_random_workloads_always_finish(num_blocks: int, block_size: int) -> None:
    pool_tokens = num_blocks * block_size
    total_preemptions = 0
    for seed in range(8):
        rng = random.Random(seed * 1000 + num_blocks)
        sim = Simulation(
            num_blocks,
            block_size,
            max_concurrency=rng.randint(1, 8),
            prefill_chunk_tokens=rng.choice([1, 2, 5, 16, 64]),
        )
        arrivals: dict[int, list[tuple[str, int, int]]] = {}
        work = 0
        last_arrival = 0
        for index in range(25):
            # Each request fits the pool alone (prompt + outputs <= pool tokens), some exactly.
            total = pool_tokens if index % 6 == 0 else rng.randint(2, pool_tokens)
            prompt_len = rng.randint(1, total - 1)
            arrival = rng.choice([0, 0, rng.randint(0, 30)])
            arrivals.setdefault(arrival, []).append((f"r{index}", prompt_len, total - prompt_len))
            work += total
            last_arrival = max(last_arrival, arrival)
        # Once a request is the oldest running one, it computes >= 1 token every step and is
        # never preempted; so every step either advances some request's last run or waits for
        # an arrival.
        bound = work + last_arrival + 1
        expected: dict[str, int] = {}
        for step in range(bound + 1):
            for request_id, prompt_len, num_outputs in arrivals.get(step, []):
                sim.add(request_id, prompt_len, num_outputs)
                expected[request_id] = num_outputs
            if step > last_arrival and not sim.scheduler.has_unfinished:
                break
            sim.step()
        assert not sim.scheduler.has_unfinished, f"seed {seed}: stuck after {sim.num_steps} steps"
        assert sim.num_steps <= bound
        assert len(sim.finished) == 25
        assert sim.num_samples == expected  # no sampled token was lost or repeated
        assert all(r.num_output_tokens == expected[r.request_id] for r in sim.finished)
        assert sim.blocks.num_used_blocks == 0
        assert sim.blocks.num_free_blocks == num_blocks
        total_preemptions += sim.scheduler.num_preemptions
    assert total_preemptions > 0  # the workloads do exercise preemption
