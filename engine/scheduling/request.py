"""A request's mutable state while the engine serves it, and the results it returns."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from dgpp.engine.sampling.sampler import TokenLogprobs
from dgpp.engine.sampling.sampling_params import SamplingParams
from dgpp.engine.vision.spans import ImageSpan, PromptImage

if TYPE_CHECKING:
    from dgpp.engine.tokenization.detokenizer import IncrementalDetokenizer


class PromptIds(list[int]):
    """A rendered prompt's token ids, with the positions worth a prefix-cache boundary (the end
    of the system prompt: hybrid models snapshot their recurrent state there) and its images
    (`dgpp.engine.vision.spans.PromptImage`, in prompt order, each standing in a run of image
    placeholder tokens). It is a plain list of ids to everything else;
    `LLMEngine.add_request` reads the hints and the images."""

    def __init__(
        self,
        ids: Iterable[int] = (),
        cache_hints: Iterable[int] = (),
        images: Iterable[PromptImage] = (),
    ) -> None:
        super().__init__(ids)
        self.cache_hints: tuple[int, ...] = tuple(cache_hints)
        self.images: tuple[PromptImage, ...] = tuple(images)

    def __add__(self, other: Iterable[int]) -> PromptIds:  # type: ignore[override]
        """Appending (a forced tool-call opening) keeps the hints and the images."""
        return PromptIds([*self, *other], self.cache_hints, self.images)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # cancelled by the caller


@dataclass
class Request:
    """The one record of a request in flight: owned by the engine, moved between queues by the
    scheduler, read by the runner and the output processor.

    `token_ids` is the prompt followed by every generated token. The first `num_computed_tokens`
    of them have keys and values in the blocks of `block_table`. `seq_id` names the request in
    the step messages other ranks receive (unique among the requests in flight). `detokenizer`
    turns its output into text and finds stop strings (None where nothing reads the text, as in
    scheduler tests); `prompt` is the prompt text when one was given.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    generator: torch.Generator | None = None
    seq_id: int = 0
    prompt: str | None = None
    detokenizer: IncrementalDetokenizer | None = None
    use_prefix_cache: bool = True  # the request may read (and fill) the prefix cache
    fills_prefix_cache: bool = True  # its computed blocks are offered to the prefix cache
    matcher: Any = None  # the llguidance matcher of params.grammar, on rank 0
    reasoning: Any = None  # its ReasoningBudget when params.reasoning_budget is set
    arrival_time: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    num_preemptions: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # `prompt_logprobs`: prompt position p's token's log-probability (p >= 1), by position (a
    # recomputed chunk writes the same values again)
    prompt_logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)
    # Rank 0's consumer of the raw logits that score the prompt (`dgpp eval`), called as
    # sink(first target position, logits [n, V]) in place of recording `prompt_logprobs`
    score_sink: Callable[[int, torch.Tensor], None] | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    num_host_tokens: int = 0  # of those, tokens loaded back from the host tier
    num_disk_tokens: int = 0  # of those, tokens the host tier had fetched from the disk tier
    disk_pending: int = 0  # fetches from the disk tier it waits for (out of the step till 0)
    prompt_class: str | None = None  # "short" or "long", by the prefill it needed (admission)
    # Scheduling order (`dgpp.engine.scheduling.priority`): the priority less what it aged,
    # set by the scheduler each step; when it last got tokens to compute (or was queued).
    rank: int = 0
    progressed_at: float | None = None
    images: tuple[PromptImage, ...] = ()  # the prompt's images, in order (vision-language)
    pooled: tuple[float, ...] | None = None  # a pooling engine's result (`step_pooling`)
    num_hashed_blocks: int = 0  # leading full blocks already offered to the prefix cache
    block_hashes: list[int] = field(default_factory=list)  # chained hash of each full block
    spec_history: Any = None  # the n-gram proposer's array of token_ids (speculative decoding)
    # Recurrent layers (hybrid models): the request's state slot, a snapshot slot to restore
    # into it before its next chunk (a prefix hit), a draft slot to copy into it before its
    # next row (the state at a verify row's last accepted token), and the positions whose
    # state is snapshotted for the prefix cache (`dgpp.engine.cache.state_snapshots`).
    state_slot: int = -1
    restore_from: int | None = None
    accepted_state: int | None = None
    snapshot_points: tuple[int, ...] = ()
    # A prompt chunk computed in layer slices (`dgpp.engine.scheduling.layer_slices`): its tokens
    # and the layers done so far (0: none in flight). Its tokens count as computed after the last
    # slice.
    slice_tokens: int = 0
    slice_layers: int = 0
    slice_layer_s: float = 0.0  # a layer of it, as its slices measured (0: none yet)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        self.rank = self.params.priority
        if self.progressed_at is None:
            self.progressed_at = self.arrival_time

    def take_slice(self, tokens: int, stop: int, total: int) -> bool:
        """A layer slice of a `tokens`-token chunk ran through layer `stop` of `total`: True
        while layers are left (the chunk stays in flight), False once its last is done."""
        if stop < total:
            self.slice_tokens, self.slice_layers = tokens, stop
            return True
        self.drop_slice()
        return False

    def drop_slice(self) -> None:
        """No chunk in flight: its last layer done, or preempted (recomputed from layer 0)."""
        self.slice_tokens = self.slice_layers = 0
        self.slice_layer_s = 0.0

    @property
    def image_spans(self) -> tuple[ImageSpan, ...]:
        """Where the prompt's images sit (`dgpp.engine.vision.spans`)."""
        return tuple(image.span for image in self.images)

    @property
    def session(self) -> str | None:
        """The agent session it belongs to (`dgpp.engine.cache.sessions`), if any."""
        return self.params.session

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_pending_tokens(self) -> int:
        """Tokens whose keys and values still have to be computed."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass(frozen=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    stop_reason: str | int | None = None
    logprobs: tuple[TokenLogprobs, ...] | None = None


@dataclass(frozen=True)
class RequestTimings:
    """Monotonic-clock instants of one request (`time.monotonic()`), for latency metrics."""

    arrival: float
    first_scheduled: float | None
    first_token: float | None
    finished: float | None


@dataclass(frozen=True)
class RequestOutput:
    """What the engine reports for one request after a step (`finished` once it is done)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    outputs: tuple[CompletionOutput, ...]
    finished: bool
    text_delta: str = ""
    num_new_tokens: int = 0
    num_cached_tokens: int = 0
    timings: RequestTimings | None = None
    prompt_class: str | None = None  # "short" / "long": see `Request.prompt_class`
    # With `prompt_logprobs`: each prompt token's (the first's None), once the prompt is read
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None
    priority: int = 0  # the request's `SamplingParams.priority`
    # A pooling engine's (`engine.kind`): the embedding, or the reranker's score, once finished
    pooled: tuple[float, ...] | None = None
