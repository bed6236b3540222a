"""The engine step: schedule -> execute on every rank -> take in the output."""

from __future__ import annotations

import copy
import itertools
import time
from dataclasses import replace
from pathlib import Path

import torch

from dgpp.engine.cache.block_manager import BlockManager
from dgpp.engine.cache.prefix_cache import HashPrefixCache, NullPrefixCache, stable_salt
from dgpp.engine.cache.sessions import SessionTable
from dgpp.engine.cache.state_snapshots import StateBook, snapshot_points
from dgpp.engine.configuration.engine_config import EngineConfig
from dgpp.engine.configuration.parallel import ParallelContext
from dgpp.engine.distributed.control import Command, ControlChannel
from dgpp.engine.errors import InvalidRequestError, check_context
from dgpp.engine.execution.model_runner import ModelRunner
from dgpp.engine.execution.step_message import StepMessage
from dgpp.engine.execution.tier_setup import rank0_tiers, report_tiers
from dgpp.engine.planning.resolved import ResolvedConfig
from dgpp.engine.sampling.grammar import Grammars
from dgpp.engine.sampling.reasoning_budget import ReasoningBudget
from dgpp.engine.sampling.sampler import Sampler
from dgpp.engine.sampling.sampling_defaults import load_sampling_defaults
from dgpp.engine.sampling.sampling_params import SamplingParams
from dgpp.engine.scheduling.output_processor import OutputProcessor
from dgpp.engine.scheduling.priority import queues_by_priority
from dgpp.engine.scheduling.request import FinishReason, PromptIds, Request, RequestOutput
from dgpp.engine.scheduling.scheduler import Scheduler, StepPlan
from dgpp.engine.scheduling.stats import EngineCounters, EngineStats
from dgpp.engine.scheduling.step_policy import StepPolicy
from dgpp.engine.scheduling.step_pooling import pooling_for
from dgpp.engine.speculative.mtp_drafter import MtpDrafter
from dgpp.engine.speculative.mtp_runner import drafter_for
from dgpp.engine.speculative.ngram import NgramProposer, Proposer
from dgpp.engine.tokenization.detokenizer import IncrementalDetokenizer
from dgpp.engine.tokenization.tokenizer import check_token_ids, eos_token_ids, load_tokenizer


class LLMEngine:
    """Serves many requests at once on one rank. Not thread-safe: one caller drives `step()`."""

    def __init__(
        self,
        resolved: ResolvedConfig,
        parallel: ParallelContext | None = None,
        control: ControlChannel | None = None,
        resident_dir: Path | None = None,
    ) -> None:
        """`resolved` (`dgpp.engine.planning.resolved.resolve`): the configuration, the checkpoint's
        and where it is. `parallel` and `control` make this rank 0 of a tensor-parallel world (of
        `resolved.tp_size` ranks) whose other ranks run `serve_commands`; without them the
        engine is a world of one. `resident_dir`: see `ModelRunner`."""
        config, model_config, checkpoint = resolved.engine, resolved.model, resolved.checkpoint
        assert (parallel.tp_size if parallel else 1) == resolved.tp_size
        max_model_len = resolved.max_model_len
        self.config = config
        self.model_config = model_config
        self.checkpoint = checkpoint
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.tokenizer = load_tokenizer(checkpoint, model_config.architecture)
        self.eos_token_ids = eos_token_ids(checkpoint, model_config, self.tokenizer)
        self.grammars = Grammars(self.tokenizer, model_config.vocab_size, self.eos_token_ids)
        self.sampling_defaults = load_sampling_defaults(checkpoint)
        self.runner = ModelRunner(
            self.config,
            model_config,
            checkpoint,
            max_model_len,
            parallel,
            resident_dir,
            drafter_for(config),
        )
        self.control = control
        self.counters = EngineCounters()
        self.sampler = Sampler(model_config.vocab_size)
        self.generator = torch.Generator(device=self.runner.device)
        if config.seed is not None:
            self.generator.manual_seed(config.seed)
        else:
            self.generator.seed()
        self._ids = itertools.count()
        self._reset_requests()

    def _reset_requests(self) -> None:
        """No request in flight and an empty prefix cache (KV held elsewhere is gone)."""
        config = self.config
        layout = self.runner.state_layout
        states = None
        if layout.num_running:  # recurrent layers: state slots and prefix snapshots
            states = StateBook(layout, max(config.prefix_min_tokens, config.block_size))
        cache = HashPrefixCache() if config.prefix_cache else NullPrefixCache()
        if states is not None and isinstance(cache, HashPrefixCache):
            cache.on_evict = states.snapshots.drop  # a snapshot is found through its block
        # Keys also cover the checkpoint and dtype: blocks of another model never match.
        salt = stable_salt(str(self.checkpoint.resolve()), config.resolved_dtype)
        host, disk, state_tiers = rank0_tiers(self.runner, config)
        self.block_manager = BlockManager(
            config.num_kv_blocks, config.block_size, cache, salt, states, host, disk, state_tiers,
            SessionTable(config.session_ttl_s),
        )  # fmt: skip
        proposer: Proposer | None = None
        self.drafter: MtpDrafter | None = None
        # Hybrid models verify with the state after each draft position kept in draft slots.
        if config.speculative == "ngram":
            proposer = NgramProposer(
                config.spec_depth, config.spec_ngram_max, config.spec_ngram_min
            )
        elif config.speculative == "mtp":  # the runner built the MTP layer (or refused)
            proposer = self.drafter = MtpDrafter(config.spec_depth, config.spec_adaptive)
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_concurrency,
            config.prefill_chunk_tokens,
            self.counters,
            proposer,
            StepPolicy.of(config, self.runner.model),
            config.priority_aging_s,
        )
        if self.drafter is not None:  # a batch-aware depth prices draft tokens by step times
            self.drafter.times = self.scheduler.times
        self.processor = OutputProcessor(
            self.scheduler,
            self.sampler,
            self.generator,
            self.counters,
            self.eos_token_ids,
            self.max_model_len,
            pooling_for(config.kind, self.tokenizer, self.model_config.is_encoder),
        )
        self.runner.forget_world()
        if self.runner.disk is not None:  # no read from disk in flight (a new world)
            self.runner.disk.drain()
        self._abort_requested: set[str] = set()

    def rejoin(self, control: ControlChannel) -> None:
        """Serve a re-formed world through `control`. Whatever was in flight is dropped (its
        callers were already failed) and the prefix cache starts empty: a restarted rank's KV
        pool holds none of the cached blocks."""
        self.control = control
        self._reset_requests()

    def retune(self, config: EngineConfig) -> None:
        """Run on with `config`, which differs from the running one only in live knobs (the
        step policy's; `dgpp.appliance.runtime.live_reload` checks): from the next step on, and
        for the requests already in flight. Call it from the thread that steps."""
        self.config = config
        self.scheduler.policy = StepPolicy.of(config, self.runner.model)
        self.block_manager.sessions.table.ttl_s = config.session_ttl_s
        self.scheduler.aging_s = config.priority_aging_s

    def heartbeat(self) -> None:
        """Tell idle workers rank 0 is alive (their wait for the next command has a deadline)."""
        if self.control is not None:
            self.control.send(Command.HEARTBEAT)

    def warm_up(self) -> None:
        """One tiny forward on every rank, so the first request does not pay for lazy kernel
        setup."""
        assert not self.scheduler.requests, "warm_up runs before any request"
        if self.control is not None:
            self.control.send(Command.WARM_UP)
        self.runner.warm_up()

    @property
    def max_model_len(self) -> int:
        assert self.config.max_model_len is not None
        return self.config.max_model_len

    @property
    def has_recurrent_state(self) -> bool:
        """The model has recurrent layers (Qwen3-Next): prefix hits need state snapshots."""
        return self.block_manager.states is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        use_prefix_cache: bool = True,
        cache_hints: tuple[int, ...] = (),
        arrival_time: float | None = None,
    ) -> Request:
        """Validate and queue a request; raise a typed error for input that can never run.
        `use_prefix_cache=False` neither reads nor fills the prefix cache for this request.
        `cache_hints`: prompt positions worth a prefix-cache boundary (the end of the system
        prompt), where hybrid models snapshot their recurrent state. `arrival_time`: when the
        request reached the engine's queue (`time.monotonic()`), while a step may have been
        running; latency metrics and the step policy's deadlines count from it."""
        number = next(self._ids)
        request_id = request_id if request_id is not None else f"req-{number}"
        if request_id in self.scheduler.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in flight")
        if isinstance(prompt, PromptIds) and not cache_hints:
            cache_hints = prompt.cache_hints
        prompt_ids = self._prompt_ids(prompt)
        images = prompt.images if isinstance(prompt, PromptIds) else ()
        if images:
            self.runner.check_images(prompt_ids, images)
            vision = self.counters.vision
            vision.requests += 1
            vision.images += len(images)
            vision.tokens += sum(image.span.tokens for image in images)
        if params.logit_bias:
            check_token_ids(list(params.logit_bias), self.model_config.vocab_size, "logit_bias")
        num_prompt = len(prompt_ids)
        max_tokens = params.max_tokens or self.max_model_len - num_prompt
        if self.processor.pooling is not None:  # the prompt alone, its last row the result
            max_tokens = 1
        # An encoder draws no token: its prompt may fill the context.
        check_context(num_prompt, self.max_model_len + self.model_config.is_encoder, max_tokens)
        if params.prompt_logprobs is not None and num_prompt > self.config.max_scored_prompt_tokens:
            raise InvalidRequestError(
                f"the prompt has {num_prompt} tokens; scoring a prompt (prompt_logprobs, or echo "
                f"with logprobs) is limited to {self.config.max_scored_prompt_tokens} "
                "(engine.max_scored_prompt_tokens)",
                param="prompt_logprobs",
            )
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.runner.device).manual_seed(params.seed)
        config = self.config
        fills_cache = (
            use_prefix_cache and config.prefix_cache and num_prompt >= config.prefix_min_tokens
        )
        if not fills_cache:
            self.counters.prefix_cache.skipped_inserts += 1
        request = Request(
            request_id,
            prompt_ids,
            params,
            max_tokens,
            generator,
            seq_id=number,
            prompt=prompt if isinstance(prompt, str) else None,
            detokenizer=IncrementalDetokenizer(
                self.tokenizer,
                prompt_ids,
                params.stop,
                params.include_stop_str_in_output,
                params.skip_special_tokens,
            ),
            # scoring the prompt computes every position: cached ones have no logits
            use_prefix_cache=use_prefix_cache and params.prompt_logprobs is None,
            fills_prefix_cache=fills_cache,
            matcher=self.grammars.matcher(params.grammar) if params.grammar else None,
            reasoning=ReasoningBudget(
                params.reasoning_budget,
                params.reasoning_end,
                params.reasoning_open,
                params.reasoning_close,
            )
            if params.reasoning_budget is not None
            else None,
            images=images,
        )
        if arrival_time is not None:
            request.arrival_time = min(arrival_time, request.arrival_time)
        if self.block_manager.states is not None and fills_cache:
            request.snapshot_points = snapshot_points(
                num_prompt, cache_hints, config.block_size, config.prefix_min_tokens
            )
        self.scheduler.add(request)
        return request

    def shutdown(self) -> None:
        """Release the other ranks of the world in order (they dissolve it and wait for the
        next one)."""
        if self.control is not None:
            self.control.send(Command.SHUTDOWN)
            self.control = None
        if self.runner.disk is not None:  # the prefix blocks queued reach the disk first
            self.runner.disk.flush()

    def abort(self, request_id: str) -> None:
        """Cancel a request; its blocks return to the pool at the next step."""
        if request_id in self.scheduler.requests:
            self._abort_requested.add(request_id)

    def step(self) -> list[RequestOutput]:
        outputs = self._reap_aborted()
        plan = self.scheduler.schedule()
        if plan.is_empty:
            self._run_tiers()
            return outputs
        message = self.runner.message(plan)  # ids, new tokens, block-table changes
        if self.block_manager.num_fetching:  # every rank reports on the reads from disk
            message = replace(message, poll=self.block_manager.num_fetching)
        if self.control is not None:
            self.control.send(Command.STEP, message)  # every rank, same forward
        started = time.perf_counter()
        logits = self.runner.execute(message)  # [plan.num_sampled, padded_vocab]
        self.block_manager.settle_fetches(self.runner.fetch_states if message.poll else [])
        outputs += self.processor.update(plan, logits)
        if self.drafter is not None:
            self._draft(plan)
        self.scheduler.observe(plan, time.perf_counter() - started)  # the step-time bound
        if not self.scheduler.has_unfinished:  # the last blocks' writes go out now
            self._run_tiers()
        return outputs

    def _run_tiers(self) -> None:
        """A step of the disk tier's work alone, when no row is scheduled: the ops recorded
        since the last step (writes, reads) and a look at the fetches (waiting a little)."""
        manager = self.block_manager
        if manager.disk is None:
            return
        manager.begin_step()
        copies, poll = manager.take_copies(), manager.num_fetching
        if not copies and not poll:
            return
        message = StepMessage((), 0, copies=copies, poll=poll)
        if self.control is not None:
            self.control.send(Command.STEP, message)
        self.runner.execute(message)
        manager.settle_fetches(self.runner.fetch_states if poll else [])

    def _draft(self, plan: StepPlan) -> None:
        """The MTP layer's pass over the step just taken in, on every rank: its drafts for the
        next step."""
        assert self.drafter is not None
        message = self.drafter.message(plan, self.runner.tables, self.block_manager)
        if not message.rows:
            return
        if self.control is not None:
            self.control.send(Command.DRAFT, message)
        self.drafter.store(plan, message, self.runner.draft(message))

    def stats(self) -> EngineStats:
        """A snapshot of the counters and queues, safe to hand to another thread."""
        scheduler = self.scheduler
        states = self.block_manager.states
        counters = copy.deepcopy(self.counters)
        counters.prefix_cache.evictions = self.block_manager.cache.num_evictions
        report_tiers(counters.prefix_cache, self.block_manager, self.runner)
        if (vision := self.runner.vision) is not None:
            counters.vision.encoded = vision.images_encoded
            counters.vision.encoder_seconds = vision.encoder_seconds
            counters.vision.cache_hits = vision.cache.hits
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
            speculative=self.config.speculative if self.scheduler.proposer else "off",
            spec_depth=self._spec_depth(),
            snapshots=states.snapshots.stats() if states is not None else None,
            snapshot_capacity=states.snapshots.num_slots if states is not None else 0,
            step_model=scheduler.times.snapshot(),
            kernels=dict(self.runner.selfcheck.states),
            kernel_checks=[result.to_json() for result in self.runner.selfcheck.results],
            allreduce=list(self.runner.selfcheck.allreduce),
            queues_by_priority=queues_by_priority(scheduler.running, scheduler.waiting),
            sessions=self.block_manager.sessions.rows(self.config.block_size),
        )

    def _spec_depth(self) -> int:
        """Draft tokens per step at most: the drafter's (MTP: one), the knob's (n-gram)."""
        if self.drafter is not None:
            return self.drafter.depth
        return self.config.spec_depth if self.scheduler.proposer else 0

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

    def _reap_aborted(self) -> list[RequestOutput]:
        outputs = []
        for request_id in self._abort_requested:
            request = self.scheduler.requests.get(request_id)
            if request is not None:  # it may have finished since the abort was asked for
                self.processor.finish(request, FinishReason.ABORT, None)
                outputs.append(self.processor.output(request, num_new_tokens=0))
        self._abort_requested.clear()
        return outputs
