"""Counters the engine keeps, and the immutable snapshot it hands to metrics readers."""

from __future__ import annotations

from dataclasses import dataclass, field

from dgpp.engine.cache.state_snapshots import SnapshotStats


@dataclass
class SpecCounters:
    """Cumulative speculative-decoding counters (rank 0), in vLLM's terms: a *draft* is one
    verify row with at least one proposed token."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # index i: draft token i

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += num_drafted
        self.accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_drafted:
            self.accepted_per_position += [0] * (num_drafted - len(self.accepted_per_position))
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1


@dataclass
class PrefixCacheCounters:
    """Cumulative prefix-cache counters (rank 0). `queries` counts admitted requests that looked
    the cache up; a `hit` found at least one cached block."""

    queries: int = 0
    hits: int = 0
    misses: int = 0
    hit_tokens: int = 0  # prompt tokens whose KV came from the cache (= tokens saved)
    host_hit_tokens: int = 0  # of those, tokens loaded back from the host tier
    host_spilled_blocks: int = 0  # evicted device blocks kept in the host tier
    host_loaded_blocks: int = 0  # host-tier blocks copied back for a hit
    host_evicted_blocks: int = 0  # host-tier blocks dropped for newer ones
    disk_hit_tokens: int = 0  # of `host_hit_tokens`, tokens the disk tier had fetched
    disk_blocks: int = 0  # blocks with files now (rank 0's index)
    disk_saved_blocks: int = 0  # blocks written to the disk tier (queued on every rank)
    disk_unsaved_blocks: int = 0  # writes skipped: a full backlog or a full disk
    disk_fetched_blocks: int = 0  # blocks read back into the host tier on every rank
    disk_failed_blocks: int = 0  # fetches missing, truncated or corrupt on some rank (misses)
    disk_dropped_blocks: int = 0  # files deleted for newer blocks (the budget)
    disk_read_bytes: int = 0  # rank 0's bytes read for fetches, and the seconds they took
    disk_read_seconds: float = 0.0
    evictions: int = 0  # cached blocks evicted to make room
    inserted_blocks: int = 0
    skipped_inserts: int = 0  # requests not inserted: under the floor, opted out, or cache off
    ttft_hit_sum_s: float = 0.0
    ttft_hit_count: int = 0
    ttft_miss_sum_s: float = 0.0
    ttft_miss_count: int = 0


@dataclass
class VisionCounters:
    """Cumulative image counters of a vision-language model (rank 0): what admitted prompts
    carried, and what rank 0's encoder did (every rank encodes the same images)."""

    requests: int = 0  # admitted requests with at least one image
    images: int = 0  # images in admitted prompts
    tokens: int = 0  # their vision tokens (prompt tokens)
    encoded: int = 0  # images the encoder ran on
    encoder_seconds: float = 0.0  # the time it took
    cache_hits: int = 0  # images read from the encoder cache instead (a repeated image)


@dataclass
class ClassLatency:
    """Queue time (arrival to first scheduled) and TTFT sums of the requests of one prompt
    class that produced a first token (rank 0)."""

    queue_sum_s: float = 0.0
    ttft_sum_s: float = 0.0
    count: int = 0
    # Finished requests with two tokens or more: the sum of their mean inter-token gaps
    itl_sum_s: float = 0.0
    itl_count: int = 0


PROMPT_CLASSES = ("short", "long")
MAX_PRIORITY_CLASSES = 32  # distinct priorities counted apart; the rest count as "other"


def priority_class(table: dict[str, ClassLatency], priority: int) -> ClassLatency:
    """The latency record of `priority` in `table` (made on first use)."""
    label = str(priority)
    if label not in table and len(table) >= MAX_PRIORITY_CLASSES:
        label = "other"
    return table.setdefault(label, ClassLatency())


def _class_latencies() -> dict[str, ClassLatency]:
    return {name: ClassLatency() for name in PROMPT_CLASSES}


@dataclass
class EngineCounters:
    """Cumulative engine counters, updated only by the engine thread."""

    num_steps: int = 0
    num_decode_steps: int = 0  # steps that ran at least one decode row
    num_layer_slices: int = 0  # steps that ran a layer slice of a prompt chunk
    tokens_generated: int = 0
    prompt_tokens_total: int = 0  # prompt tokens of admitted requests
    prompt_tokens_computed: int = 0  # prompt tokens actually run through the model
    num_preemptions: int = 0
    prefix_cache: PrefixCacheCounters = field(default_factory=PrefixCacheCounters)
    spec_decode: SpecCounters = field(default_factory=SpecCounters)
    vision: VisionCounters = field(default_factory=VisionCounters)
    # By prompt class ("short" / "long", `Request.prompt_class`): the scheduler's own rule.
    prompt_classes: dict[str, ClassLatency] = field(default_factory=_class_latencies)
    # By request priority (`SamplingParams.priority`, as a string), made on first use.
    priority_classes: dict[str, ClassLatency] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineStats:
    """A consistent snapshot for readers on other threads (metrics endpoints, the stats log)."""

    running: int
    waiting: int
    prefilling: int
    kv_blocks_total: int
    kv_blocks_in_use: int
    block_size: int
    prefix_cache_enabled: bool
    prefix_min_tokens: int
    counters: EngineCounters
    speculative: str = "off"  # the drafting method ("off", "ngram" or "mtp")
    spec_depth: int = 0  # draft tokens proposed per step at most; 0 when off
    snapshots: SnapshotStats | None = None  # recurrent-state snapshots (hybrid models)
    snapshot_capacity: int = 0  # snapshot slots
    # The step-time model's fitted constants (`StepTimes.snapshot`): seconds, None until fitted.
    step_model: dict[str, float | None] = field(default_factory=dict)
    # The start-up self-check (`dgpp.engine.selfcheck`): {kernel: "ok" | "fallback: reason"}
    # and every case's result; empty where it did not run (CPU ranks).
    kernels: dict[str, str] = field(default_factory=dict)
    kernel_checks: list[dict[str, object]] = field(default_factory=list)
    allreduce: list[dict[str, float]] = field(default_factory=list)  # at warm-up, worlds > 1
    # Requests in the queues now by priority: {"0": {"waiting": 1, "running": 3}}
    queues_by_priority: dict[str, dict[str, int]] = field(default_factory=dict)
    # Agent sessions (`SessionBook.rows`), most recently seen first
    sessions: list[dict[str, object]] = field(default_factory=list)

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_in_use / self.kv_blocks_total if self.kv_blocks_total else 0.0
