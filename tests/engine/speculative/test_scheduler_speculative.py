"""The scheduler with speculative decoding: where verify rows go in a plan, and the blocks a draft
may take (never one a newer running row needs)."""

from __future__ import annotations

from dgpp.engine.cache.block_manager import BlockManager
from dgpp.engine.sampling.sampling_params import SamplingParams
from dgpp.engine.scheduling.request import Request, RequestStatus
from dgpp.engine.scheduling.scheduler import Scheduler
from dgpp.engine.speculative.ngram import NgramProposer

PARAMS = SamplingParams()


def _decoding(request_id: str, tokens: list[int], blocks: BlockManager) -> Request:
    """A running request with one token pending (its slot not allocated yet), the rest
    computed."""
    request = Request(request_id, tokens, PARAMS, max_tokens=32)
    assert blocks.allocate_slots(request, len(tokens) - 1)
    request.num_computed_tokens = len(tokens) - 1
    request.status = RequestStatus.RUNNING
    return request


def test_a_draft_becomes_a_verify_row_among_the_decodes() -> None:
    blocks = BlockManager(num_blocks=16, block_size=4)
    scheduler = Scheduler(blocks, 8, 16, proposer=NgramProposer(4, 2, 1))
    repeating = _decoding("repeat", [1, 2, 3, 4, 5, 1, 2], blocks)
    fresh = _decoding("fresh", [9, 8, 7], blocks)
    scheduler.running = [repeating, fresh]
    plan = scheduler.schedule()
    assert plan.num_decodes == 2 and not plan.has_prefill
    verify, plain = plan.chunks
    assert (verify.start, verify.num_tokens, verify.draft) == (6, 5, (3, 4, 5, 1))
    assert verify.is_sampling and verify.num_sampled == 5
    assert (plain.num_tokens, plain.draft, plain.num_sampled) == (1, (), 1)
    assert plan.num_sampled == 6
    assert len(repeating.block_table) == 3  # room for positions 6..10


def test_a_draft_never_takes_the_block_a_newer_decode_needs() -> None:
    blocks = BlockManager(num_blocks=5, block_size=4)
    scheduler = Scheduler(blocks, 8, 16, proposer=NgramProposer(4, 2, 1))
    older = _decoding("older", [1, 2, 3, 1, 2, 3, 1, 2, 3], blocks)  # 8 computed: 2 blocks
    newer = _decoding("newer", [5, 6, 7, 8, 9], blocks)  # 4 computed: 1 block, needs a 2nd
    scheduler.running = [older, newer]
    # Free: 2 blocks. The draft (1, 2, 3, 1) would take both (positions 8..12), and the newer
    # row would then preempt itself; instead both run as plain decode rows.
    assert scheduler.proposer is not None
    assert scheduler.proposer.propose(older, 10) == (1, 2, 3, 1)
    plan = scheduler.schedule()
    assert [chunk.draft for chunk in plan.chunks] == [(), ()]
    assert not plan.preempted and scheduler.running == [older, newer]
    assert blocks.num_free_blocks == 0
