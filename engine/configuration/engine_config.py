"""The engine's knobs (`EngineConfig`): the one place each is declared
(`dgpp.engine.configuration.knobs`).

The deployment's `engine:`, `speculative:` and `resident_cache:` sections, the `dgpp serve /
chat / generate` flags, `LLM(**knobs)`, the console's form and docs/engine.md's table all come
from the fields below. More on what they do: docs/engine.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

from dgpp.engine.configuration.device_knobs import DeviceKnobs
from dgpp.engine.configuration.knobs import Rule, check_knobs, knob
from dgpp.engine.errors import ConfigError
from dgpp.engine.quant.methods import METHODS

if TYPE_CHECKING:
    from dgpp.engine.checkpoint.config import ModelConfig

Dtype = Literal["float32", "bfloat16", "float16"]
PrefillPrecision = Literal["fp32", "model"]
Speculative = Literal["off", "ngram", "mtp"]
Kind = Literal["generate", "embed", "rerank"]
Quantization = Literal[("auto", "none", *METHODS)]  # type: ignore[valid-type]
DTYPES: tuple[str, ...] = Dtype.__args__  # type: ignore[attr-defined]


@dataclass(frozen=True)
class EngineConfig(DeviceKnobs):
    """Engine knobs. `model` is the checkpoint (a directory, a Hugging Face repo id or
    `default`); every other field is a knob."""

    KNOB_SECTION: ClassVar[str] = "engine"
    RULES: ClassVar[tuple[Rule, ...]] = (
        Rule(
            ("spec_ngram_min", "spec_ngram_max"),
            lambda low, high: low <= high,
            "{0} ({v0}) must not exceed {1} ({v1})",
        ),
        Rule(
            ("prefix_cache_disk_gib", "prefix_cache_host_gib"),
            lambda disk, host: disk == 0 or host > 0,
            "{0} ({v0}) needs {1} too: blocks read from disk are staged in the host tier",
        ),
        Rule(
            ("kind", "speculative"),
            lambda kind, speculative: kind == "generate" or speculative == "off",
            "{0} {v0} never decodes: {1} ({v1}) must be off",
        ),
    )

    model: str
    kind: Kind = knob(
        "generate",
        "what the model serves: generate (chat, completions, responses), embed (/v1/embeddings: "
        "a decoder's last-token hidden state, an encoder's pooled as its sentence-transformers "
        "files say) or rerank (/v1/rerank, /v1/score: a decoder reranker's yes/no logits, as "
        "Qwen3-Reranker's, or a cross-encoder's classifier); an encoder (BERT, XLM-RoBERTa) "
        "serves the one kind its class does",
        label="Model kind",
        group="api",
    )
    dtype: Dtype | None = knob(
        None,
        "weight and activation dtype",
        when_unset="float32 on CPU, bfloat16 on CUDA",
    )
    device: str = knob(
        "cpu", "where the model runs", pattern=r"cpu|cuda(:\d+)?", allowed="cpu, cuda or cuda:N"
    )
    kv_capacity: int = knob(
        16384,
        "tokens the KV-cache pool holds, on every rank (rounded up to whole blocks)",
        label="KV capacity",
        group="memory",
        unit="tokens",
        ge=1,
    )
    block_size: int = knob(16, "tokens per KV block", unit="tokens", ge=1)
    max_model_len: int | None = knob(
        None,
        "tokens per request, prompt and output together",
        label="Max context",
        group="memory",
        unit="tokens",
        ge=1,
        when_unset="the smaller of the model's position limit and the pool",
    )
    prefill_precision: PrefillPrecision = knob(
        "fp32",
        "fp32 computes prefill attention and its logits in float32 (exact); model keeps the "
        "model dtype (faster)",
        label="Prefill precision",
        group="memory",
    )
    prefill_chunk_tokens: int = knob(
        512,
        "prompt tokens computed per step across all prefills (the step's prompt budget)",
        label="Prefill chunk",
        group="scheduling",
        unit="tokens",
        ge=1,
    )
    max_scored_prompt_tokens: int = knob(
        32768,
        "longest prompt a request may score (prompt_logprobs, or echo with logprobs); longer "
        "ones are refused",
        label="Longest scored prompt",
        group="memory",
        advanced=True,
        unit="tokens",
        ge=1,
    )
    quantization: Quantization = knob(
        "auto",
        "auto serves the checkpoint as it is stored; a method (or none) refuses a checkpoint "
        "stored otherwise, before loading",
        label="Quantization",
        group="memory",
    )
    short_prompt_tokens: int = knob(
        256,
        "prompts with at most this many tokens left go before long ones",
        label="Short prompt",
        group="scheduling",
        advanced=True,
        unit="tokens",
        ge=1,
        live=True,
    )
    long_prefill_share: float = knob(
        0.25,
        "share of a step's prompt budget the oldest long prompt keeps while short ones are served",
        label="Long prefill share",
        group="scheduling",
        advanced=True,
        gt=0.0,
        le=1.0,
        live=True,
    )
    session_ttl_s: float = knob(
        600.0,
        "an agent session (prompt_cache_key, metadata.user_id, x-session-id) keeps its cached "
        "blocks ahead of anonymous ones while it has been idle less than this; expired "
        "sessions' blocks go first among sessions",
        label="Session TTL",
        group="memory",
        advanced=True,
        unit="s",
        gt=0.0,
        live=True,
    )
    priority_aging_s: float = knob(
        10.0,
        "a request kept from progressing this long ranks one priority level better, so lower "
        "priorities still advance (a request d levels down waits at most about d times this); "
        "0: priorities never age",
        label="Priority aging",
        group="scheduling",
        advanced=True,
        unit="s",
        ge=0.0,
        live=True,
    )
    step_target_ms: float = knob(
        0.0,
        "while streams decode, steps with prompt work stay near this time (0: from the "
        "predicted time of the latency-sensitive work; negative: unbounded)",
        label="Step target (ms)",
        group="scheduling",
        advanced=True,
        unit="ms",
        live=True,
    )
    arrival_hold_ms: float = knob(
        1000.0,
        "for this long after a request arrives, steps that carry only long prompts stay as short "
        "as a short request's first token, so the next arrival waits for no long chunk "
        "(0: long chunks at once; models whose long chunks go in layer slices stay bounded)",
        label="Arrival hold (ms)",
        group="scheduling",
        advanced=True,
        unit="ms",
        ge=0.0,
        live=True,
    )
    max_concurrency: int = knob(
        64,
        "requests in the running batch at most",
        label="Max concurrency",
        group="scheduling",
        ge=1,
    )
    prefix_cache: bool = knob(
        True,
        "reuse the KV blocks of earlier requests that share a prefix",
        label="Prefix cache",
        group="prefix",
    )
    prefix_min_tokens: int = knob(
        1024,
        "prompts shorter than this may hit the prefix cache but add nothing to it",
        label="Prefix cache floor",
        group="prefix",
        advanced=True,
        unit="tokens",
        ge=0,
    )
    image_cache_tokens: int = knob(
        32768,
        "vision-language models: image tokens of encoder output kept per rank by image "
        "content, so a repeated image (a screenshot in an agent's history) is encoded once",
        label="Image encoder cache",
        group="memory",
        advanced=True,
        unit="tokens",
        ge=0,
    )
    prefix_cache_host_gib: float = knob(
        0.0,
        "host memory per rank for prefix-cache blocks the KV pool evicts: kept there and "
        "loaded back on a later hit instead of recomputed (0: off; hybrid models give half to "
        "their recurrent-state snapshots)",
        label="Prefix cache host tier (GiB)",
        group="prefix",
        unit="GiB",
        ge=0.0,
        le=float(1 << 20),  # beyond any machine
    )
    prefix_cache_disk_gib: float = knob(
        0.0,
        "disk space per rank for prefix-cache blocks, written as they are computed and kept "
        "across restarts; a later hit reads them back through the host tier (0: off; needs "
        "the host tier; hybrid models give half to their snapshots)",
        label="Prefix cache disk tier (GiB)",
        group="prefix",
        unit="GiB",
        ge=0.0,
        le=float(1 << 30),
    )
    prefix_cache_dir: str | None = knob(
        None,
        "the disk tier's directory, on the node's local disk (not the weights mount)",
        label="Prefix cache directory",
        group="prefix",
        advanced=True,
        pattern=r"[/~$][^\x00]*",
        allowed="an absolute path (or one from ~ or a $VARIABLE)",
        when_unset="the node's ($DGPP_PREFIX_CACHE_DIR, else ~/.cache/dgpp/prefix)",
    )
    prefix_cache_gib: float = knob(
        4.0,
        "memory per rank for the prefix cache's recurrent-state snapshots (hybrid models such "
        "as Qwen3-Next)",
        label="Prefix snapshots (GiB)",
        group="prefix",
        advanced=True,
        unit="GiB",
        ge=0.0,
        le=float(1 << 20),  # beyond any machine
    )
    speculative: Speculative = knob(
        "off",
        "speculative decoding: ngram drafts tokens from the request's own history, mtp with the "
        "checkpoint's multi-token-prediction layer (DeepSeek-V3, GLM-4.5, Qwen3-Next, Qwen3.5); "
        "the target verifies them in one forward; the output is unchanged",
        label="Speculative decoding",
        group="speculative",
        deployment="speculative.method",
        flag="--spec",
        negation=("--no-spec", "off"),
    )
    spec_depth: int = knob(
        4,
        "draft tokens verified per step at most",
        label="Speculative depth",
        group="speculative",
        unit="tokens",
        ge=1,
        le=16,
        deployment="speculative.depth",
    )
    spec_adaptive: bool = knob(
        True,
        "mtp: each request drafts as deep as its recent acceptance pays, at most the depth",
        label="Adaptive depth",
        group="speculative",
        advanced=True,
        deployment="speculative.adaptive",
    )
    spec_ngram_max: int = knob(
        4,
        "longest suffix of the history looked up",
        label="N-gram max",
        group="speculative",
        advanced=True,
        unit="tokens",
        ge=1,
        le=16,
        deployment="speculative.ngram_max",
    )
    spec_ngram_min: int = knob(
        2,
        "shortest suffix looked up; at most n-gram max",
        label="N-gram min",
        group="speculative",
        advanced=True,
        unit="tokens",
        ge=1,
        le=16,
        deployment="speculative.ngram_min",
    )
    native_decode: bool = knob(
        True,
        "CPU decode steps of the plain Llama-family decoder run every layer in one native call "
        "(kernels/cpu/decoder_step.cpp); off: the PyTorch layer path, for comparison",
        label="Native CPU decode",
        group="scheduling",
        advanced=True,
    )
    ngram_tables_in_memory: bool = knob(
        False,
        "read Qwen4-Exp's PLE n-gram tables into host RAM at start (counted by the memory "
        "plan) instead of reading their rows from the checkpoint per token",
        label="N-gram tables in RAM",
        group="speculative",
        advanced=True,
    )
    seed: int | None = knob(
        None, "seed of the sampler for requests without their own", when_unset="random"
    )
    num_threads: int | None = knob(
        None, "CPU threads", ge=1, flag="--threads", when_unset="PyTorch's default"
    )
    tokenizer: str | None = knob(
        None,
        "the tokenizer's directory",
        deployment=None,
        flag=None,
        when_unset="the checkpoint's",
    )
    resident_cache: bool = knob(
        True,
        "keep this rank's final weights as an image and map it on the next start",
        deployment="resident_cache.enabled",
    )
    resident_cache_dir: str | None = knob(
        None,
        "where the resident images live",
        deployment="resident_cache.dir",
        flag=None,
        when_unset="the node's ($DGPP_RESIDENT_DIR, else ~/.cache/dgpp/resident); LLM alone "
        "keeps none",
    )

    def __post_init__(self) -> None:
        check_knobs(self)

    @property
    def num_kv_blocks(self) -> int:
        return -(-self.kv_capacity // self.block_size)

    @property
    def resolved_dtype(self) -> str:
        if self.dtype is not None:
            return self.dtype
        return "bfloat16" if self.device.startswith("cuda") else "float32"

    def effective_max_model_len(self, model: ModelConfig) -> int:
        pool_tokens = self.num_kv_blocks * self.block_size
        limit = min(model.max_position_embeddings, pool_tokens)
        if self.max_model_len is None:
            return limit
        if self.max_model_len > limit:
            raise ConfigError(
                f"max_model_len={self.max_model_len} exceeds what this model and KV pool allow "
                f"({limit}: position limit {model.max_position_embeddings}, "
                f"pool {pool_tokens} tokens)"
            )
        return self.max_model_len
