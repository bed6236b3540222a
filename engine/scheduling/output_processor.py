"""What the engine does with a step's logits: sample them (verifying drafts), append the tokens,
find stops, finish requests, free or trim their blocks, and report every request that moved."""

from __future__ import annotations

import time
from collections.abc import Collection

import torch

from dgpp.engine.cache.block_manager import BlockManager
from dgpp.engine.sampling.sampler import Sampler, TokenLogprobs
from dgpp.engine.scheduling.request import (
    CompletionOutput,
    FinishReason,
    Request,
    RequestOutput,
    RequestTimings,
)
from dgpp.engine.scheduling.scheduler import Scheduler, StepPlan
from dgpp.engine.scheduling.stats import EngineCounters, priority_class
from dgpp.engine.scheduling.step_pooling import Pooling, pooled_rows
from dgpp.engine.scheduling.step_sampling import SampledRow, sample_step


class OutputProcessor:
    """Rank 0's half of a step after the forward. Requests it finishes leave the scheduler."""

    def __init__(
        self,
        scheduler: Scheduler,
        sampler: Sampler,
        generator: torch.Generator,
        counters: EngineCounters,
        eos_token_ids: Collection[int],
        max_model_len: int,
        pooling: Pooling | None = None,
    ) -> None:
        """`pooling`: a pooling engine's (`engine.kind` embed or rerank), whose requests end
        with their prompt, a result in place of tokens."""
        self.scheduler = scheduler
        self.pooling = pooling
        self.block_manager: BlockManager = scheduler.block_manager
        self.sampler = sampler
        self.generator = generator
        self.counters = counters
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def update(self, plan: StepPlan, logits: torch.Tensor) -> list[RequestOutput]:
        """Take in the forward of `plan` (logits [plan.num_sampled, V]); one output per sampled
        request, in plan order."""
        counters = self.counters
        counters.num_steps += 1
        counters.num_decode_steps += plan.num_decodes > 0
        counters.num_layer_slices += any(chunk.layers is not None for chunk in plan.chunks)
        for chunk in plan.chunks:
            request = chunk.request
            # A layer slice: its tokens count once its last layer is done.
            if chunk.layers is not None and request.take_slice(chunk.num_tokens, *chunk.layers[1:]):
                continue
            if chunk.draft:
                # The last known token's KV is computed; each draft token's counts once accepted.
                request.num_computed_tokens += 1
                continue
            prompt_end = min(chunk.start + chunk.num_tokens, request.num_prompt_tokens)
            counters.prompt_tokens_computed += max(0, prompt_end - chunk.start)
            request.num_computed_tokens += chunk.num_tokens
            self._cache_blocks(request)
        if self.pooling is not None:
            return self._pool(plan, logits, self.pooling)
        outputs = []
        for row in sample_step(plan, logits, self.sampler, self.generator, self.eos_token_ids):
            num_new = self._take(row)
            counters.tokens_generated += num_new
            request = row.request
            if row.chunk.draft:
                counters.spec_decode.record(len(row.chunk.draft), row.num_accepted(num_new))
            if not request.is_finished:
                self.block_manager.trim(request)  # a rejected draft's blocks
                if row.chunk.draft:  # and its recurrent state
                    chunk = row.chunk
                    self.block_manager.keep_accepted_state(request, chunk.start, chunk.num_tokens)
            outputs.append(self.output(request, num_new_tokens=num_new))
        return outputs

    def _pool(self, plan: StepPlan, logits: torch.Tensor, pooling: Pooling) -> list[RequestOutput]:
        outputs = []
        for request, value in pooled_rows(plan, logits, pooling):
            request.pooled = value
            request.first_token_time = time.monotonic()  # its time to first token is its latency
            self._count_first_token(request)
            self.finish(request, FinishReason.STOP, None)
            outputs.append(self.output(request, num_new_tokens=0))
        return outputs

    def finish(self, request: Request, reason: FinishReason, stop_reason: str | int | None) -> None:
        request.finished_time = time.monotonic()
        request.finish_reason = reason
        request.stop_reason = stop_reason
        self.scheduler.finish(request)
        gaps = request.num_output_tokens - 1
        if request.first_token_time is not None and gaps > 0:
            latency = priority_class(self.counters.priority_classes, request.params.priority)
            latency.itl_sum_s += (request.finished_time - request.first_token_time) / gaps
            latency.itl_count += 1

    def output(self, request: Request, num_new_tokens: int) -> RequestOutput:
        """The request as its caller sees it now: the text produced since the last output, and
        everything so far."""
        detokenizer = request.detokenizer
        assert detokenizer is not None, "the engine gives every request a detokenizer"
        delta = detokenizer.take_delta()
        finished = request.is_finished
        if finished:
            delta += detokenizer.flush()
        completion = CompletionOutput(
            index=0,
            text=detokenizer.text,
            token_ids=tuple(request.output_token_ids),
            finish_reason=request.finish_reason.value if request.finish_reason else None,
            stop_reason=request.stop_reason,
            logprobs=tuple(request.logprobs) if request.params.logprobs is not None else None,
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=tuple(request.prompt_token_ids),
            outputs=(completion,),
            finished=finished,
            text_delta=delta,
            num_new_tokens=num_new_tokens,
            num_cached_tokens=request.num_cached_tokens,
            timings=RequestTimings(
                arrival=request.arrival_time,
                first_scheduled=request.first_scheduled_time,
                first_token=request.first_token_time,
                finished=request.finished_time,
            ),
            prompt_class=request.prompt_class,
            prompt_logprobs=_prompt_logprobs(request),
            priority=request.params.priority,
            pooled=request.pooled,
        )

    def _take(self, row: SampledRow) -> int:
        """Append the row's tokens up to the first that finishes the request; how many."""
        request = row.request
        for depth, (token_id, logprobs) in enumerate(zip(row.token_ids, row.logprobs, strict=True)):
            if depth:
                # The token before this one confirmed a draft token: its KV is right.
                request.num_computed_tokens += 1
                self._cache_blocks(request)
            self._append(request, token_id, logprobs)
            if request.is_finished:
                return depth + 1
        return len(row.token_ids)

    def _append(self, request: Request, token_id: int, logprobs: TokenLogprobs | None) -> None:
        request.token_ids.append(token_id)
        if logprobs is not None:
            request.logprobs.append(logprobs)
        if request.first_token_time is None:
            request.first_token_time = time.monotonic()
            self._count_first_token(request)
        params = request.params
        if token_id in params.stop_token_ids:
            self.finish(request, FinishReason.STOP, token_id)
        elif token_id in self.eos_token_ids and not params.ignore_eos:
            self.finish(request, FinishReason.STOP, None)
        else:
            assert request.detokenizer is not None
            stop = request.detokenizer.add_token(token_id)
            budget = request.reasoning
            if budget is not None and budget.answer_due:  # a forced close: text to come
                answer = request.output_token_ids[budget.answer_from :]
                budget.answer_due = not request.detokenizer.text_of(answer).strip()
            if stop is not None:
                self.finish(request, FinishReason.STOP, stop)
            elif (
                request.num_output_tokens >= request.max_tokens
                or request.num_tokens >= self.max_model_len
            ):
                self.finish(request, FinishReason.LENGTH, None)

    def _cache_blocks(self, request: Request) -> None:
        if request.fills_prefix_cache:
            added = self.block_manager.cache_computed_blocks(request)
            self.counters.prefix_cache.inserted_blocks += added

    def _count_first_token(self, request: Request) -> None:
        assert request.first_token_time is not None
        ttft = request.first_token_time - request.arrival_time
        cache = self.counters.prefix_cache
        if request.num_cached_tokens:
            cache.ttft_hit_sum_s += ttft
            cache.ttft_hit_count += 1
        else:
            cache.ttft_miss_sum_s += ttft
            cache.ttft_miss_count += 1
        by_priority = priority_class(self.counters.priority_classes, request.params.priority)
        for latency in (self.counters.prompt_classes.get(request.prompt_class or ""), by_priority):
            if latency is not None and request.first_scheduled_time is not None:
                latency.queue_sum_s += request.first_scheduled_time - request.arrival_time
                latency.ttft_sum_s += ttft
                latency.count += 1


def _prompt_logprobs(request: Request) -> tuple[TokenLogprobs | None, ...] | None:
    """The prompt's tokens' log-probabilities, the first's None, once all are known."""
    scored = request.prompt_logprobs
    if request.params.prompt_logprobs is None or len(scored) < request.num_prompt_tokens - 1:
        return None
    return (None, *(scored[at] for at in range(1, request.num_prompt_tokens)))
