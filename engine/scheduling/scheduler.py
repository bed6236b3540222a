"""Continuous batching with chunked prefill, under the interactive step policy.

Each step the scheduler plans a decode row for every running request that has finished its
prompt (a verify row of its last token and a draft, when speculative decoding proposes one),
then shares a prompt-token budget among prompts as `step_policy` says: short prompts first, the
oldest long prompt always advancing, new requests admitted every step. When the pool runs out of
blocks, the newest running request not yet in the plan is preempted (its blocks freed, to be
recomputed later), never an older one for a newer one: the oldest request can always progress,
because admission refused any request that could not fit the pool alone. With priorities
(`priority`) "oldest" reads "best ranked, then oldest": the running rows are kept in rank order,
and a waiting request that outranks a running one may take its place.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dgpp.engine.cache.block_manager import BlockManager
from dgpp.engine.cache.host_tier import Copy
from dgpp.engine.scheduling.priority import rerank
from dgpp.engine.scheduling.request import Request, RequestStatus
from dgpp.engine.scheduling.stats import EngineCounters
from dgpp.engine.scheduling.step_policy import LongCredit, StepPolicy
from dgpp.engine.scheduling.step_times import StepTimes

if TYPE_CHECKING:
    from dgpp.engine.speculative.ngram import Proposer


@dataclass(frozen=True)
class ScheduledChunk:
    """Compute `num_tokens` tokens of `request`, starting at position `start`. A verify row ends
    with the `draft` tokens proposed after the request's last known token; they count in
    `num_tokens` and every one of the row's positions is sampled."""

    request: Request
    start: int
    num_tokens: int
    draft: tuple[int, ...] = ()
    # A layer slice (first, stop, of how many): this step computes only those layers of the
    # chunk (`dgpp.engine.scheduling.layer_slices`); None: every layer.
    layers: tuple[int, int, int] | None = None

    @property
    def end(self) -> int:
        """The position after the chunk's last known token."""
        return self.start + self.num_tokens - len(self.draft)

    @property
    def completes(self) -> bool:
        """After this step the chunk's tokens are computed through the last layer."""
        return self.layers is None or self.layers[1] == self.layers[2]

    @property
    def is_sampling(self) -> bool:
        """The chunk reaches the end of the known tokens, so its last logits choose the next one."""
        end = self.start + self.num_tokens - len(self.draft)
        return self.completes and end == self.request.num_tokens

    @property
    def num_scored(self) -> int:
        """Leading positions of this chunk whose logits score the next prompt token (a request
        with `prompt_logprobs`): every computed position before the prompt's last."""
        request = self.request
        if request.params.prompt_logprobs is None or self.draft or not self.completes:
            return 0
        last = request.num_prompt_tokens - 1
        return max(0, min(self.start + self.num_tokens, last) - self.start)

    @property
    def num_sampled(self) -> int:
        """Positions of this chunk whose logits the step returns: those it scores, then those
        the sampler reads (trailing: a chunk scores all its positions but the sampled one)."""
        return self.num_scored + (1 + len(self.draft) if self.is_sampling else 0)


@dataclass(frozen=True)
class StepPlan:
    """One engine step: decode rows first (one token each, or a verify row's last token and
    draft), then prefill chunks."""

    chunks: tuple[ScheduledChunk, ...]
    num_decodes: int
    preempted: tuple[Request, ...] = ()
    # Requests finished since the last plan that was sent: every rank forgets their tables.
    finished_seq_ids: tuple[int, ...] = ()
    # Recurrent state copies (slot, slot): snapshots restored before the forward, saved after.
    restores: tuple[tuple[int, int], ...] = ()
    saves: tuple[tuple[int, int], ...] = ()
    # Host-tier copies (`dgpp.engine.cache.host_tier`), run in order before the forward.
    copies: tuple[Copy, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    @property
    def num_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)

    @property
    def has_prefill(self) -> bool:
        return self.num_decodes < len(self.chunks)

    @property
    def num_sampled(self) -> int:
        return sum(chunk.num_sampled for chunk in self.chunks)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_concurrency: int,
        prefill_chunk_tokens: int,
        counters: EngineCounters | None = None,
        proposer: Proposer | None = None,
        policy: StepPolicy | None = None,
        aging_s: float = 0.0,
    ) -> None:
        self.block_manager = block_manager
        self.policy = policy or StepPolicy(prefill_chunk_tokens=prefill_chunk_tokens)
        self.times = StepTimes()
        self.credit = LongCredit()  # the oldest long prompt's banked step time
        self.proposer = proposer
        self.max_concurrency = max_concurrency
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.counters = counters if counters is not None else EngineCounters()
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_seq_ids: list[int] = []
        self.last_arrival: float | None = None  # the newest request's arrival (monotonic)
        self.aging_s = aging_s  # not progressing this long gains a priority level (0: never)
        self._held: set[int] = set()  # ids of the requests displaced this step

    @property
    def num_preemptions(self) -> int:
        return self.counters.num_preemptions

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        assert request.request_id not in self.requests, "request ids are unique in flight"
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)
        self.block_manager.arrive(request)  # its session seen; blocks on disk start coming back
        self.last_arrival = max(self.last_arrival or request.arrival_time, request.arrival_time)

    def finish(self, request: Request) -> None:
        """Remove a finished or aborted request from the queues and free its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.block_manager.free(request)
        request.status = RequestStatus.FINISHED
        self.requests.pop(request.request_id, None)
        self._finished_seq_ids.append(request.seq_id)

    def schedule(self) -> StepPlan:
        self.block_manager.begin_step()  # sessions released, the last step's snapshots saved
        decodes: list[ScheduledChunk] = []  # verify rows included
        prefills: list[ScheduledChunk] = []
        preempted: list[Request] = []
        slices: dict[int, int] = {}  # layers this step of a chunk computed in layer slices
        now = time.monotonic()
        rerank([*self.running, *self.waiting], now, self.aging_s)
        self.running.sort(key=lambda request: request.rank)  # stable: oldest first within a rank
        displaced = self._displace()
        self._held = {id(request) for request in displaced}  # back next step at the earliest
        amounts = self._prompt_amounts(slices)
        index = 0
        # Oldest first; preemption takes from the tail, so it never touches a planned request.
        while index < len(self.running):
            request = self.running[index]
            pending = request.num_pending_tokens
            is_decode = pending == 1
            num_tokens = 1 if is_decode else amounts.get(id(request), 0)
            if num_tokens > 1:  # a prefill chunk ends on the next state snapshot point
                start = request.num_computed_tokens
                num_tokens = self.block_manager.chunk_limit(request, start, num_tokens)
            if num_tokens == 0:
                index += 1
                continue
            reserve = len(self.running) - index - 1  # newer rows may each need a block
            if is_decode and (verify := self._verify_row(request, reserve)) is not None:
                decodes.append(verify)
                index += 1
                continue
            if not self._allocate_or_preempt(request, num_tokens, preempted):
                break  # `request` itself was preempted; everything newer already was
            chunk = ScheduledChunk(
                request, request.num_computed_tokens, num_tokens, (), self._layers(request, slices)
            )
            (decodes if is_decode else prefills).append(chunk)
            index += 1
        # Admission, every step unless this one had to preempt: in the policy's order, and a
        # request waiting for blocks is not overtaken by one the policy puts after it.
        restores: list[tuple[int, int]] = []
        for request in [r for r in self._admission_order() if id(r) in amounts]:
            if preempted:
                break
            chunk = self._admit(request, amounts[id(request)], self._layers(request, slices))
            if chunk is None:
                break
            if (restore := self.block_manager.take_restore(request)) is not None:
                restores.append(restore)
            (decodes if request.num_pending_tokens == 1 else prefills).append(chunk)
        prefills.sort(key=lambda chunk: chunk.layers is not None)  # a slice runs last
        chunks = tuple(decodes + prefills)
        for chunk in chunks:
            chunk.request.progressed_at = now
        preempted = displaced + preempted
        finished: tuple[int, ...] = ()
        copies: tuple[Copy, ...] = ()
        # Snapshot slots reserved first: a snapshot dropped for the slot is copied out (to the
        # host tier) by this step's copies, before the forward saves into the slot.
        saves = [
            save
            for chunk in prefills
            if chunk.completes
            and (save := self.block_manager.snapshot_save(chunk.request, chunk.end)) is not None
        ]
        if chunks:  # an empty plan is not sent: the next one carries these
            copies = self.block_manager.take_copies()
            finished = tuple(self._finished_seq_ids)
            self._finished_seq_ids.clear()
            # Verify rows' states at their last accepted token first (hybrid models).
            accepted = (self.block_manager.take_accepted_state(r) for r in self.running)
            restores = [pair for pair in accepted if pair is not None] + restores
        return StepPlan(
            chunks, len(decodes), tuple(preempted), finished, tuple(restores), tuple(saves), copies
        )

    def observe(self, plan: StepPlan, seconds: float) -> None:
        """What the step of `plan` took (the step-time bound learns from it)."""
        prompts = plan.chunks[plan.num_decodes :]
        whole = [(chunk.start, chunk.num_tokens) for chunk in prompts if chunk.layers is None]
        sliced = [
            (chunk.start, chunk.num_tokens, (chunk.layers[1] - chunk.layers[0]) / chunk.layers[2])
            for chunk in prompts
            if chunk.layers is not None
        ]
        self.times.observe(seconds, plan.num_decodes, whole, sliced[0] if sliced else None)
        # What a layer of a chunk in flight takes, measured where the step held nothing else.
        alone = plan.chunks[0] if len(plan.chunks) == 1 else None
        if alone is not None and alone.layers is not None and not alone.completes:
            alone.request.slice_layer_s = seconds / (alone.layers[1] - alone.layers[0])

    def _layers(self, request: Request, slices: dict[int, int]) -> tuple[int, int, int] | None:
        """The layer slice (first, stop, of how many) of `request`'s chunk this step; None when
        the chunk runs through every layer at once."""
        layers = slices.get(id(request))
        if layers is None:
            return None
        total, first = self.policy.num_layers, request.slice_layers
        if first == 0 and layers >= total:
            return None
        return first, min(first + layers, total), total

    def _admission_order(self) -> list[Request]:
        """The waiting requests that may start this step (free concurrency slots), in the
        policy's order; one whose blocks are still coming back from disk waits aside."""
        slots = max(self.max_concurrency - len(self.running), 0)
        ready = [r for r in self.waiting if not r.disk_pending and id(r) not in self._held]
        return self.policy.order([], ready)[:slots]

    def _prompt_amounts(self, slices: dict[int, int]) -> dict[int, int]:
        """Prompt tokens each prompt may compute this step (by request id), as the policy
        shares the budget among running prompts and the waiting requests that may start; the
        layers of a chunk in layer slices go to `slices`."""
        decodes = [r.rank for r in self.running if r.num_pending_tokens == 1]
        running = [r for r in self.running if r.num_pending_tokens > 1]
        waiting = self._admission_order()
        amounts = self.policy.share(self.policy.prefill_chunk_tokens, running, waiting)
        now, prompts = time.monotonic(), running + waiting
        # Decode rows all ranked below the best prompt do not bound its steps (`priority`).
        if not decodes or min(decodes) <= min((r.rank for r in prompts), default=0):
            clock = (self.times, now, self.last_arrival, self.credit, slices)
            amounts = self.policy.bound(amounts, prompts, len(decodes), *clock)
        for request in running:  # a chunk in flight keeps its tokens, whatever its class now
            if request.slice_layers and id(request) in amounts:
                amounts[id(request)] = request.slice_tokens
                slices.setdefault(id(request), self.policy.num_layers - request.slice_layers)
        return amounts

    def _admit(
        self, request: Request, num_tokens: int, layers: tuple[int, int, int] | None = None
    ) -> ScheduledChunk | None:
        hit_tokens = 0
        if not request.block_table:
            hit_tokens = self.block_manager.match_prefix(request)  # cached: no budget
        num_tokens = min(request.num_pending_tokens, num_tokens)
        if num_tokens > 1:
            start = request.num_computed_tokens
            num_tokens = self.block_manager.chunk_limit(request, start, num_tokens)
        if not self.block_manager.allocate_slots(request, num_tokens):
            self.block_manager.free(request)  # let go of the matched prefix while waiting
            return None
        self.waiting.remove(request)
        if request.first_scheduled_time is None:
            self._count_admission(request, hit_tokens)
        request.status = RequestStatus.RUNNING
        bisect.insort(self.running, request, key=lambda r: r.rank)  # after its equals: oldest first
        if request.num_pending_tokens == 1:
            layers = None  # a decode row
        return ScheduledChunk(request, request.num_computed_tokens, num_tokens, (), layers)

    def _verify_row(self, request: Request, reserve: int) -> ScheduledChunk | None:
        """The request's last token and a draft after it, when one is proposed and its slots
        fit the pool with `reserve` blocks to spare, so a draft never makes a later row preempt
        anyone (a plain decode row is planned otherwise)."""
        if self.proposer is None:
            return None
        # Every draft token could be accepted, and one more token follows the last of them.
        draft = self.proposer.propose(request, request.max_tokens - request.num_output_tokens - 1)
        if not draft:
            return None
        manager = self.block_manager
        if manager.blocks_needed(request, 1 + len(draft)) + reserve > manager.num_free_blocks:
            return None
        if not manager.allocate_slots(request, 1 + len(draft)):
            return None
        return ScheduledChunk(request, request.num_computed_tokens, 1 + len(draft), draft)

    def _allocate_or_preempt(
        self, request: Request, num_tokens: int, preempted: list[Request]
    ) -> bool:
        while not self.block_manager.allocate_slots(request, num_tokens):
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return False
        return True

    def _displace(self) -> list[Request]:
        """Preempt the worst-ranked running requests for ready waiting ones that outrank them
        and would not fit otherwise: no free concurrency slot, or fewer free blocks than their
        first chunk needs beside the running decode rows' (counted without prefix hits: a hit
        only needs fewer)."""
        displaced: list[Request] = []
        ready = sorted(
            (r for r in self.waiting if not r.disk_pending), key=lambda request: request.rank
        )
        slots = blocks = 0  # what the better-ranked waiting requests before this one need
        manager = self.block_manager

        def fits() -> bool:
            rows = (r for r in self.running if r.num_pending_tokens == 1)
            decodes = sum(manager.blocks_needed(r, 1) for r in rows)
            room = len(self.running) + slots <= self.max_concurrency
            return room and blocks + decodes <= manager.num_free_blocks

        for request in ready:
            first = min(request.num_pending_tokens, self.prefill_chunk_tokens)
            slots, blocks = slots + 1, blocks + manager.blocks_needed(request, first)
            while self.running and self.running[-1].rank > request.rank and not fits():
                victim = self.running[-1]
                self._preempt(victim)
                displaced.append(victim)
        return displaced

    def _count_admission(self, request: Request, hit_tokens: int) -> None:
        request.first_scheduled_time = time.monotonic()
        request.num_cached_tokens = hit_tokens
        # The policy's own rule, on the prefill left after the cache hit: a cached agent turn
        # with a short new tail is a short prompt.
        request.prompt_class = "short" if self.policy.is_short(request) else "long"
        if request.prompt_class == "short":
            self.times.observe_short(request.num_pending_tokens)
        self.counters.prompt_tokens_total += request.num_prompt_tokens
        cache = self.counters.prefix_cache
        if request.use_prefix_cache and self.block_manager.cache.enabled:
            cache.queries += 1
            cache.hits += request.num_cached_tokens > 0
            cache.misses += request.num_cached_tokens == 0
            cache.hit_tokens += request.num_cached_tokens
            cache.host_hit_tokens += request.num_host_tokens
            cache.disk_hit_tokens += request.num_disk_tokens

    def _preempt(self, request: Request) -> None:
        """Free the request's blocks and queue it first, to recompute its tokens when it returns."""
        self.running.remove(request)
        self.block_manager.free(request)
        request.status = RequestStatus.WAITING
        request.drop_slice()  # a chunk in flight is recomputed too
        request.num_preemptions += 1
        request.progressed_at = time.monotonic()  # it ages from here (`priority`)
        self.counters.num_preemptions += 1
        self.waiting.appendleft(request)
