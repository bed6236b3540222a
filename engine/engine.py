"""The engine step: schedule -> run -> sample -> append, for every request in flight."""

from __future__ import annotations

import copy
import itertools
import time
from dataclasses import replace
from pathlib import Path

import torch

from dgpp.engine.block_manager import BlockManager
from dgpp.engine.config import EngineConfig, ModelConfig
from dgpp.engine.detokenizer import IncrementalDetokenizer
from dgpp.engine.distributed.control import Command, ControlChannel, ControlMessage
from dgpp.engine.errors import ContextLengthExceededError, InvalidRequestError
from dgpp.engine.memory_plan import size_kv_pool
from dgpp.engine.model_runner import ModelRunner
from dgpp.engine.models.registry import model_class
from dgpp.engine.parallel import ParallelContext
from dgpp.engine.prefix_cache import HashPrefixCache, NullPrefixCache
from dgpp.engine.request import (
    CompletionOutput,
    FinishReason,
    Request,
    RequestOutput,
    RequestTimings,
)
from dgpp.engine.sampler import Sampler, SamplerRow, TokenLogprobs
from dgpp.engine.sampling_defaults import load_sampling_defaults
from dgpp.engine.sampling_params import SamplingParams
from dgpp.engine.scheduler import Scheduler
from dgpp.engine.speculative import NgramProposer
from dgpp.engine.stats import EngineCounters, EngineStats
from dgpp.engine.tokenizer import check_token_ids, eos_token_ids, load_tokenizer
from dgpp.engine.verify import sample_plan


class LLMEngine:
    """Serves many requests at once on one rank. Not thread-safe: one caller drives `step()`."""

    def __init__(
        self,
        config: EngineConfig,
        checkpoint: Path,
        parallel: ParallelContext | None = None,
        control: ControlChannel | None = None,
    ) -> None:
        """`parallel` and `control` make this rank 0 of a tensor-parallel world whose other
        ranks run `serve_commands`; without them the engine is a world of one."""
        model_config = ModelConfig.from_checkpoint(checkpoint)
        model_class(model_config)  # refuse unknown architectures before any heavy loading
        # memory_fraction: the KV pool is sized here, once; other ranks must run the result.
        config = size_kv_pool(config, model_config, parallel.tp_size if parallel else 1)
        max_model_len = config.effective_max_model_len(model_config)
        self.config = replace(config, max_model_len=max_model_len)
        self.model_config = model_config
        self.checkpoint = checkpoint
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.tokenizer = load_tokenizer(checkpoint)
        self.eos_token_ids = eos_token_ids(checkpoint, model_config, self.tokenizer)
        self.sampling_defaults = load_sampling_defaults(checkpoint)
        self.runner = ModelRunner(self.config, model_config, checkpoint, max_model_len, parallel)
        self.control = control
        self.counters = EngineCounters()
        self._reset_requests()
        self.sampler = Sampler(model_config.vocab_size)
        self.generator = torch.Generator(device=self.runner.device)
        if config.seed is not None:
            self.generator.manual_seed(config.seed)
        else:
            self.generator.seed()
        self._ids = itertools.count()

    def _reset_requests(self) -> None:
        """No request in flight and an empty prefix cache (KV held elsewhere is gone)."""
        config = self.config
        cache = HashPrefixCache() if config.prefix_cache else NullPrefixCache()
        # Keys also cover the checkpoint and dtype: blocks of another model never match.
        salt = hash((str(self.checkpoint.resolve()), config.resolved_dtype))
        self.block_manager = BlockManager(config.num_kv_blocks, config.block_size, cache, salt)
        proposer = None
        if config.speculative == "ngram":
            proposer = NgramProposer(
                config.spec_depth, config.spec_ngram_max, config.spec_ngram_min
            )
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_concurrency,
            config.prefill_chunk_tokens,
            self.counters,
            proposer,
        )
        self._requests: dict[str, Request] = {}
        self._abort_requested: set[str] = set()
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._prompts: dict[str, str | None] = {}

    def rejoin(self, control: ControlChannel) -> None:
        """Serve a re-formed world through `control`. Whatever was in flight is dropped (its
        callers were already failed) and the prefix cache starts empty: a restarted rank's KV
        pool holds none of the cached blocks."""
        self.control = control
        self._reset_requests()

    def heartbeat(self) -> None:
        """Tell idle workers rank 0 is alive (their wait for the next command has a deadline)."""
        if self.control is not None:
            self.control.send(ControlMessage(Command.HEARTBEAT))

    def warm_up(self) -> None:
        """One tiny forward on every rank, so the first request does not pay for lazy kernel
        setup. Writes only block 0's first slot, which nothing holds yet."""
        assert not self._requests, "warm_up runs before any request"
        inputs = self.runner.warm_up_inputs()
        if self.control is not None:
            self.control.send(ControlMessage(Command.STEP, inputs))
        self.runner.execute(inputs)

    @property
    def max_model_len(self) -> int:
        assert self.config.max_model_len is not None
        return self.config.max_model_len

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        use_prefix_cache: bool = True,
    ) -> Request:
        """Validate and queue a request; raise a typed error for input that can never run.
        `use_prefix_cache=False` neither reads nor fills the prefix cache for this request."""
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in flight")
        prompt_ids = self._prompt_ids(prompt)
        num_prompt = len(prompt_ids)
        if num_prompt >= self.max_model_len:
            raise ContextLengthExceededError(
                f"the prompt has {num_prompt} tokens; this model's context is {self.max_model_len} "
                "tokens and at least one must be left to generate",
                param="prompt",
            )
        max_tokens = params.max_tokens or self.max_model_len - num_prompt
        if num_prompt + max_tokens > self.max_model_len:
            raise ContextLengthExceededError(
                f"prompt ({num_prompt} tokens) plus max_tokens ({max_tokens}) exceeds this model's "
                f"context of {self.max_model_len} tokens",
                param="max_tokens",
            )
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.runner.device).manual_seed(params.seed)
        request = Request(request_id, prompt_ids, params, max_tokens, generator)
        request.use_prefix_cache = use_prefix_cache
        if not self._fills_cache(request):
            self.counters.prefix_cache.skipped_inserts += 1
        self._requests[request_id] = request
        self._prompts[request_id] = prompt if isinstance(prompt, str) else None
        self._detokenizers[request_id] = IncrementalDetokenizer(
            self.tokenizer,
            prompt_ids,
            params.stop,
            params.include_stop_str_in_output,
            params.skip_special_tokens,
        )
        self.scheduler.add(request)
        return request

    def shutdown(self) -> None:
        """Release the other ranks of the world in order (they dissolve it and wait for the
        next one)."""
        if self.control is not None:
            self.control.send(ControlMessage(Command.SHUTDOWN))
            self.control = None

    def abort(self, request_id: str) -> None:
        """Cancel a request; its blocks return to the pool at the next step."""
        if request_id in self._requests:
            self._abort_requested.add(request_id)

    def step(self) -> list[RequestOutput]:
        outputs = self._reap_aborted()
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return outputs
        inputs = self.runner.prepare(plan)
        if self.control is not None:
            self.control.send(ControlMessage(Command.STEP, inputs))  # every rank, same forward
        logits = self.runner.execute(inputs)  # [plan.num_sampled, padded_vocab]
        counters = self.counters
        counters.num_steps += 1
        counters.num_decode_steps += plan.num_decodes > 0
        for chunk in plan.chunks:
            request = chunk.request
            if chunk.draft:
                # The last known token's KV is computed; each draft token's counts once accepted.
                request.num_computed_tokens += 1
                continue
            prompt_end = min(chunk.start + chunk.num_tokens, request.num_prompt_tokens)
            counters.prompt_tokens_computed += max(0, prompt_end - chunk.start)
            request.num_computed_tokens += chunk.num_tokens
            self._cache_blocks(request)
        sampled = sample_plan(
            plan,
            logits,
            lambda part, requests: self.sampler(
                part, [self._row(r) for r in requests], self.generator
            ),
            self._append,
            self._accept_draft_token,
            counters.spec_decode,
        )
        for request, num_new in sampled:
            counters.tokens_generated += num_new
            if not request.is_finished:
                self.block_manager.trim(request)
            outputs.append(self._output(request, num_new_tokens=num_new))
        return outputs

    def _accept_draft_token(self, request: Request) -> None:
        request.num_computed_tokens += 1
        self._cache_blocks(request)

    def _cache_blocks(self, request: Request) -> None:
        if self._fills_cache(request):
            added = self.block_manager.cache_computed_blocks(request)
            self.counters.prefix_cache.inserted_blocks += added

    def _fills_cache(self, request: Request) -> bool:
        return (
            request.use_prefix_cache
            and self.config.prefix_cache
            and request.num_prompt_tokens >= self.config.prefix_min_tokens
        )

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

    def stats(self) -> EngineStats:
        """A snapshot of the counters and queues, safe to hand to another thread."""
        scheduler = self.scheduler
        counters = copy.deepcopy(self.counters)
        counters.prefix_cache.evictions = self.block_manager.cache.num_evictions
        return EngineStats(
            running=len(scheduler.running),
            waiting=len(scheduler.waiting),
            prefilling=sum(r.num_pending_tokens > 1 for r in list(scheduler.running)),
            kv_blocks_total=self.config.num_kv_blocks,
            kv_blocks_in_use=self.block_manager.num_used_blocks,
            block_size=self.config.block_size,
            prefix_cache_enabled=self.config.prefix_cache,
            prefix_min_tokens=self.config.prefix_min_tokens,
            counters=counters,
            speculative=self.config.speculative,
            spec_depth=self.config.spec_depth if self.config.speculative != "off" else 0,
        )

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = list(self.tokenizer(prompt).input_ids) if prompt else []
        elif isinstance(prompt, list | tuple):
            ids = check_token_ids(prompt, self.model_config.vocab_size)
        else:
            raise InvalidRequestError(
                f"a prompt is a string or a list of token ids, got {type(prompt).__name__}",
                param="prompt",
            )
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        return ids

    def _row(self, request: Request) -> SamplerRow:
        params = request.params
        needs_history = (
            params.repetition_penalty != 1.0
            or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0
        )
        return SamplerRow(
            params=params,
            prompt_token_ids=request.prompt_token_ids if needs_history else (),
            output_token_ids=request.output_token_ids if needs_history else (),
            generator=request.generator,
        )

    def _append(self, request: Request, token_id: int, logprobs: TokenLogprobs | None) -> None:
        request.token_ids.append(token_id)
        if logprobs is not None:
            request.logprobs.append(logprobs)
        if request.first_token_time is None:
            request.first_token_time = time.monotonic()
            self._count_first_token(request)
        params = request.params
        detokenizer = self._detokenizers[request.request_id]
        if token_id in params.stop_token_ids:
            self._finish(request, FinishReason.STOP, token_id)
        elif token_id in self.eos_token_ids and not params.ignore_eos:
            self._finish(request, FinishReason.STOP, None)
        else:
            stop = detokenizer.add_token(token_id)
            if stop is not None:
                self._finish(request, FinishReason.STOP, stop)
            elif (
                request.num_output_tokens >= request.max_tokens
                or request.num_tokens >= self.max_model_len
            ):
                self._finish(request, FinishReason.LENGTH, None)

    def _finish(
        self, request: Request, reason: FinishReason, stop_reason: str | int | None
    ) -> None:
        request.finished_time = time.monotonic()
        request.finish_reason = reason
        request.stop_reason = stop_reason
        self.scheduler.finish(request)

    def _reap_aborted(self) -> list[RequestOutput]:
        outputs = []
        for request_id in self._abort_requested:
            request = self._requests.get(request_id)
            if request is not None:  # it may have finished since the abort was asked for
                self._finish(request, FinishReason.ABORT, None)
                outputs.append(self._output(request, num_new_tokens=0))
        self._abort_requested.clear()
        return outputs

    def _output(self, request: Request, num_new_tokens: int) -> RequestOutput:
        request_id = request.request_id
        detokenizer = self._detokenizers[request_id]
        delta = detokenizer.take_delta()
        finished = request.is_finished
        if finished:
            delta += detokenizer.flush()
            del self._requests[request_id], self._detokenizers[request_id]
        completion = CompletionOutput(
            index=0,
            text=detokenizer.text,
            token_ids=tuple(request.output_token_ids),
            finish_reason=request.finish_reason.value if request.finish_reason else None,
            stop_reason=request.stop_reason,
            logprobs=tuple(request.logprobs) if request.params.logprobs is not None else None,
        )
        return RequestOutput(
            request_id=request_id,
            prompt=self._prompts.pop(request_id) if finished else self._prompts[request_id],
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
        )
