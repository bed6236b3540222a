"""MTP drafting (`speculative: mtp`, issue 37): the checkpoint's multi-token-prediction layer
proposes the next token of every decoding request, and the target verifies it as it verifies
n-gram drafts (one forward, depth-ordered acceptance: the output is unchanged).

After each step rank 0 builds a draft message (`message`): for every request still running,
the positions of that step whose target hidden states are now final, each with the token that
follows it (a prefill chunk's prompt tokens and the first sampled token; a verify row's
accepted draft tokens and the token after them). Every rank runs the MTP layer over them
(`ModelRunner.draft`: its own KV cache catches up, as a prefill), and the layer's prediction at
each request's last position is its draft for the next step (`store`, `propose`).
"""

from __future__ import annotations

from dgpp.engine.request import Request
from dgpp.engine.scheduler import StepPlan
from dgpp.engine.step_message import StepMessage, StepRow


class MtpDrafter:
    """The MTP layer's drafts, by request; one token per step (`depth` 1)."""

    depth = 1

    def __init__(self) -> None:
        self._drafts: dict[int, tuple[int, int]] = {}  # seq id -> (num_tokens then, token)

    def propose(self, request: Request, limit: int) -> tuple[int, ...]:
        """The request's draft, if one was made for its current length and `limit` allows."""
        made = self._drafts.pop(request.seq_id, None)
        if made is None or limit < 1 or made[0] != request.num_tokens:
            return ()
        return (made[1],)

    def message(self, plan: StepPlan) -> StepMessage:
        """The catch-up rows of the step `plan` ran (after its outputs were taken in): per
        running request, positions start .. num_computed - 1 and the token after each."""
        rows = []
        for chunk in plan.chunks:
            request = chunk.request
            if request.is_finished:
                self._drafts.pop(request.seq_id, None)
                continue
            valid = request.num_computed_tokens - chunk.start
            following = request.token_ids[chunk.start + 1 : chunk.start + valid + 1]
            if valid < 1 or len(following) != valid:
                continue  # preempted since, or nothing final
            rows.append(StepRow(request.seq_id, chunk.start, tuple(following), 1, 0, ()))
        return StepMessage(tuple(rows), num_decodes=0)

    def store(self, plan: StepPlan, message: StepMessage, tokens: list[int]) -> None:
        """Keep each row's draft for its request's next step, if that step decodes."""
        requests = {chunk.request.seq_id: chunk.request for chunk in plan.chunks}
        for row, token in zip(message.rows, tokens, strict=True):
            request = requests[row.seq_id]
            if request.num_pending_tokens == 1:  # the prompt is done: the next row decodes
                self._drafts[row.seq_id] = (request.num_tokens, token)
