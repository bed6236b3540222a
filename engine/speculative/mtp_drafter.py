"""MTP drafting (`speculative: mtp`, issue 37): the checkpoint's multi-token-prediction layer
proposes the next token of every decoding request, and the target verifies it as it verifies
n-gram drafts (one forward, depth-ordered acceptance: the output is unchanged).

After each step rank 0 builds a draft message (`message`): for every request still running,
the positions of that step whose target hidden states are now final, each with the token that
follows it (a prefill chunk's prompt tokens and the first sampled token; a verify row's
accepted draft tokens and the token after them). Every rank runs the MTP layer over them
(`ModelRunner.draft`: its own KV cache catches up, as a prefill), and the layer's prediction at
each request's last position is its first draft token (`store`, `propose`). Deeper drafts
chain the layer, as the field does with a checkpoint of one MTP layer: its output hidden state
and the token it drafted feed the next position, `depth - 1` more times. Every rank computes
the same greedy tokens from the same logits, so the chain needs no message of its own; the
chained positions' KV goes into slots rank 0 allocates for the request first (the next step's
verify row needs them anyway), and is overwritten by the catch-up once the tokens are known.
"""

from __future__ import annotations

from dgpp.engine.cache.block_manager import BlockManager
from dgpp.engine.execution.step_message import BlockTables, StepMessage, StepRow
from dgpp.engine.scheduling.request import Request
from dgpp.engine.scheduling.scheduler import StepPlan
from dgpp.engine.scheduling.step_times import StepTimes
from dgpp.engine.speculative.spec_depth import Acceptance, pay_threshold


class MtpDrafter:
    """The MTP layer's drafts, by request, up to `depth` tokens a step; with `adaptive`, each
    request's own depth follows its recent acceptance (`dgpp.engine.speculative.spec_depth`)."""

    def __init__(self, depth: int = 1, adaptive: bool = False) -> None:
        assert depth >= 1
        self.depth = depth
        self.adaptive = adaptive
        self._drafts: dict[int, tuple[int, tuple[int, ...]]] = {}  # seq id -> (length, tokens)
        self._acceptance: dict[int, Acceptance] = {}
        self.times: StepTimes | None = None  # the scheduler's step-time model (batch-aware depth)

    def propose(self, request: Request, limit: int) -> tuple[int, ...]:
        """The request's draft, if one was made for its current length, cut to `limit`."""
        made = self._drafts.pop(request.seq_id, None)
        if made is None or limit < 1 or made[0] != request.num_tokens:
            return ()
        return made[1][:limit]

    def message(self, plan: StepPlan, tables: BlockTables, blocks: BlockManager) -> StepMessage:
        """The catch-up rows of the step `plan` ran (after its outputs were taken in): per
        running request, positions start .. num_computed - 1 and the token after each; its
        `num_sampled` is the draft tokens wanted (0 while its prompt is still being read),
        with slots allocated for the chained positions (fewer tokens where the pool is
        short), and the table changes every rank applies."""
        rows = []
        decoding = sum(
            not c.request.is_finished and c.request.num_pending_tokens == 1 for c in plan.chunks
        )
        for chunk in plan.chunks:
            request = chunk.request
            if request.is_finished:
                self._drafts.pop(request.seq_id, None)
                self._acceptance.pop(request.seq_id, None)
                continue
            valid = request.num_computed_tokens - chunk.start
            acceptance = self._acceptance.setdefault(request.seq_id, Acceptance())
            if chunk.draft and valid >= 1:
                acceptance.observe(len(chunk.draft), valid - 1)
            following = request.token_ids[chunk.start + 1 : chunk.start + valid + 1]
            if valid < 1 or len(following) != valid:
                continue  # preempted since, or nothing final
            wanted = 0
            if request.num_pending_tokens == 1:  # the prompt is done: the next row decodes
                room = request.max_tokens - request.num_output_tokens - 1
                bar = pay_threshold(self.times, decoding, request.num_tokens)
                depth = acceptance.depth(self.depth, bar) if self.adaptive else self.depth
                wanted = max(0, min(depth, room))
                # The chained positions, T - 1 .. T + wanted - 3, need slots now.
                if wanted > 1 and not blocks.allocate_slots(request, wanted - 1):
                    wanted = 1
            kept, new = tables.change(request.seq_id, request.block_table)
            row = StepRow(request.seq_id, chunk.start, tuple(following), wanted, kept, new)
            rows.append(row)
        return StepMessage(tuple(rows), num_decodes=0)

    def store(self, plan: StepPlan, message: StepMessage, drafts: list[tuple[int, ...]]) -> None:
        """Keep each row's draft for its request's next step."""
        requests = {chunk.request.seq_id: chunk.request for chunk in plan.chunks}
        for row, tokens in zip(message.rows, drafts, strict=True):
            if tokens:
                self._drafts[row.seq_id] = (requests[row.seq_id].num_tokens, tokens)
