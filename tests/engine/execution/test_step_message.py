"""Step messages: what rank 0 sends every rank per step, and the block tables they keep."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dgpp.engine.execution.step_message import BlockTables, StepMessage, StepRow
from dgpp.engine.sampling.sampling_params import SamplingParams
from dgpp.engine.scheduling.request import Request
from dgpp.engine.scheduling.scheduler import ScheduledChunk, StepPlan
from dgpp.engine.vision.spans import ImageSpan

ints = st.integers(min_value=0, max_value=2**40)
rows = st.builds(
    StepRow,
    seq_id=ints,
    start=ints,
    token_ids=st.lists(ints, max_size=6).map(tuple),
    num_sampled=st.integers(0, 6),
    num_kept_blocks=ints,
    new_blocks=st.lists(ints, max_size=6).map(tuple),
    state_slot=st.integers(-1, 2**20),
    layers=st.tuples(st.integers(0, 200), st.integers(0, 200)),
    shift=st.integers(-(2**30), 0),
    images=st.lists(
        st.builds(ImageSpan, ints, st.just(1), st.integers(1, 99), st.integers(1, 99), ints),
        max_size=3,
    ).map(tuple),
)
triples = st.lists(st.tuples(st.integers(0, 1), ints, ints), max_size=4).map(tuple)
pairs = st.lists(st.tuples(ints, ints), max_size=4).map(tuple)
messages = st.builds(
    StepMessage,
    rows=st.lists(rows, max_size=5).map(tuple),
    num_decodes=st.integers(0, 5),
    finished=st.lists(ints, max_size=5).map(tuple),
    restores=pairs,
    saves=pairs,
    copies=triples,
    encode=st.lists(ints, max_size=3).map(tuple),
)


@given(messages)
def test_a_message_survives_its_wire_form(message: StepMessage) -> None:
    tensor = message.to_tensor()
    assert tensor.dtype == torch.int64 and tensor.dim() == 1
    assert StepMessage.from_tensor(tensor) == message


def test_a_damaged_wire_form_is_refused() -> None:
    message = StepMessage(
        (StepRow(3, 10, (5, 6), 1, 2, (7,), 4),), 0, finished=(1,), restores=((9, 4),)
    )
    tensor = message.to_tensor()
    with pytest.raises(ValueError):
        StepMessage.from_tensor(torch.cat([tensor, torch.tensor([0])]))
    with pytest.raises(ValueError):
        StepMessage.from_tensor(tensor[:-3])


def _request(seq_id: int, num_tokens: int) -> Request:
    request = Request(f"r{seq_id}", list(range(num_tokens)), SamplingParams(), 4, seq_id=seq_id)
    request.num_computed_tokens = num_tokens - 1
    return request


def _decode_plan(requests: list[Request], finished: tuple[int, ...] = ()) -> StepPlan:
    chunks = tuple(ScheduledChunk(r, r.num_tokens - 1, 1) for r in requests)
    return StepPlan(chunks, num_decodes=len(chunks), finished_seq_ids=finished)


def _send(head: BlockTables, worker: BlockTables, plan: StepPlan) -> StepMessage:
    """Rank 0 builds the message, then both sides apply it (the worker from the wire form)."""
    message = head.message(plan)
    head.apply(message)
    worker.apply(StepMessage.from_tensor(message.to_tensor()))
    return message


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32))
def test_tables_follow_every_kind_of_change_on_every_rank(seed: int) -> None:
    """Grown, trimmed, trimmed and grown, freed and reallocated, finished: after each step the
    worker holds exactly the tables rank 0's requests have."""
    rng = random.Random(seed)
    head, worker = BlockTables(), BlockTables()
    live = [_request(seq_id, 40) for seq_id in range(4)]
    next_id = 4
    for _ in range(12):
        finished: list[int] = []
        for request in list(live):
            change = rng.choice(["grow", "trim", "trim-grow", "realloc", "same", "finish"])
            table = request.block_table
            if change == "grow":
                table.extend(rng.sample(range(1000), rng.randint(1, 3)))
            elif change == "trim" and table:
                del table[rng.randrange(len(table)) :]
            elif change == "trim-grow" and table:
                del table[rng.randrange(len(table)) :]
                table.extend(rng.sample(range(1000), 2))
            elif change == "realloc":
                request.block_table = rng.sample(range(1000), rng.randint(0, 5))
            elif change == "finish":
                live.remove(request)
                finished.append(request.seq_id)
                live.append(_request(next_id, 40))
                next_id += 1
        scheduled = rng.sample(live, rng.randint(1, len(live)))
        _send(head, worker, _decode_plan(scheduled, tuple(finished)))
        for request in scheduled:
            assert worker[request.seq_id] == head[request.seq_id] == request.block_table
        for seq_id in finished:
            with pytest.raises(KeyError):
                worker[seq_id]


@pytest.mark.parametrize("context", [512, 4096, 32768, 200_000])
def test_a_decode_step_costs_the_same_at_any_context(context: int) -> None:
    """Four requests: the first step carries their tables; every later decode step only the
    blocks that were appended, so its size does not depend on how long the contexts are."""
    block_size = 16
    head, worker = BlockTables(), BlockTables()
    requests = [_request(seq_id, context) for seq_id in range(4)]
    for index, request in enumerate(requests):
        first = index * 20_000
        request.block_table = list(range(first, first + -(-context // block_size)))
    _send(head, worker, _decode_plan(requests))
    sizes = []
    for step in range(3):
        for request in requests:
            request.token_ids.append(7)
            request.num_computed_tokens += 1
            if step == 1:  # one request's context crossed into a new block
                request.block_table.append(90_000 + request.seq_id)
        sizes.append(_send(head, worker, _decode_plan(requests)).to_tensor().numel())
    # header + 4 rows of (11 fields + 1 token), and one new block for each row at the crossing
    assert sizes == [8 + 4 * 12, 8 + 4 * 13, 8 + 4 * 12]
