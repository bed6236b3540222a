"""The deployment file: one strict, typed model that every part of dgpp is configured from.

Unknown keys and wrong types are refused with the key's path and what is allowed. Pure functions
turn a deployment into the engine's, the server's and the world's frozen configurations.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    model_validator,
)

from dgpp.appliance.http_keys import check_key, read_key_file
from dgpp.engine.config import EngineConfig
from dgpp.engine.distributed.world import WorldSpec, WorldTimeouts
from dgpp.engine.errors import ConfigError
from dgpp.engine.server.config import ServerConfig, is_pattern


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class EngineSection(_Section):
    """Engine knobs; absent ones take `EngineConfig`'s defaults."""

    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:\d+)?)$")
    kv_capacity: int = Field(16384, ge=1)
    block_size: int = Field(16, ge=1)
    max_model_len: int | None = Field(None, ge=1)
    max_concurrency: int = Field(64, ge=1)
    prefill_chunk_tokens: int = Field(512, ge=1)
    # The interactive step policy (docs/engine.md): short prompts first, the oldest long one
    # keeps a share of the budget, steps stay near a target time while streams decode.
    short_prompt_tokens: int = Field(256, ge=1)
    long_prefill_share: float = Field(0.25, gt=0.0, le=1.0)
    step_target_ms: float = 0.0  # 0: twice the decode-only step; negative: unbounded
    prefill_precision: Literal["fp32", "model"] = "fp32"
    # auto: as the checkpoint stores it; a method name refuses a checkpoint stored otherwise
    quantization: Literal[
        "auto",
        "none",
        "gguf",
        "gptq",
        "awq",
        "auto-round",
        "compressed-tensors",
        "fp8",
        "modelopt",
        "mxfp4",
    ] = "auto"
    prefix_cache: bool = True
    prefix_min_tokens: int = Field(1024, ge=0)
    # Hybrid models (Qwen3-Next): memory per rank for the prefix cache's recurrent-state snapshots
    prefix_cache_gib: float = Field(4.0, ge=0.0)
    seed: int | None = None
    num_threads: int | None = Field(None, ge=1)
    memory_fraction: float | None = Field(None, gt=0.0, le=1.0)
    mlock: bool = False


class HttpSection(_Section):
    host: str = "127.0.0.1"
    port: int = Field(18080, ge=1, le=65535)
    api_key_file: str | None = None  # the key stays out of the deployment (and of bundles)
    admin_key_file: str | None = None  # /admin/*; without one they answer on loopback only
    metrics_require_key: bool = False  # /metrics needs the API key too (it is open otherwise)
    # A host other machines can reach needs api_key_file, unless this says serving them
    # without a key is meant (logged as a warning, shown on the console).
    allow_unauthenticated: bool = False
    served_model_names: list[str] = Field(default_factory=list)
    default_max_tokens: int | None = Field(8192, ge=1)
    # A request whose max_tokens exceeds what the context leaves after its prompt: "clamp"
    # generates until the context is full (finish reason length); "reject" refuses it.
    max_tokens_policy: Literal["clamp", "reject"] = "clamp"
    queue_limit: int = Field(256, ge=0)
    # Responses API answers kept in memory (previous_response_id, GET /v1/responses/{id}).
    responses_store_size: int = Field(1024, ge=0)
    responses_store_ttl_s: float = Field(3600.0, gt=0)
    max_body_bytes: int = Field(32 * 1024 * 1024, ge=1024)
    stats_log_interval_s: float = Field(10.0, ge=0.0)
    default_chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    # "auto": sampling settings a request leaves out come from the checkpoint's
    # generation_config.json (as vLLM does); "none": the OpenAI/Anthropic defaults.
    generation_config: Literal["auto", "none"] = "auto"
    # How the model writes tool calls and reasoning: "auto" tells it from the chat template
    # (docs/api.md, tool-call formats); a name forces that format.
    tool_call_parser: Literal[
        "auto", "hermes", "glm45", "deepseek_v3", "harmony", "qwen3_coder"
    ] = "auto"

    @model_validator(mode="after")
    def _reachable_needs_a_key(self, info: ValidationInfo) -> HttpSection:
        key_given = bool(info.context and info.context.get("api_key_given"))
        if is_loopback(self.host) or self.api_key_file or key_given or self.allow_unauthenticated:
            return self
        raise ValueError(
            f"host {self.host!r} lets other machines reach the API, and no api_key_file is "
            "set: name a file holding the key (http.api_key_file), bind 127.0.0.1, or set "
            "http.allow_unauthenticated: true to serve the network without a key"
        )


def is_loopback(host: str) -> bool:
    """Whether `host` is reachable from this machine only (127.0.0.0/8, ::1, localhost)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name, or every address ("", "0.0.0.0" parse; other names may resolve)


class RendezvousSection(_Section):
    """Where the ranks meet: the head's address as workers reach it, and the store's port."""

    head: str = "127.0.0.1"
    port: int = Field(29517, ge=1, le=65535)
    backend: Literal["auto", "gloo", "nccl"] = "auto"


class TimeoutsSection(_Section):
    """Every deadline of the runtime (see `WorldTimeouts`); also overridable from the environment
    by the CLI (`DGPP_BOUNDARY_TIMEOUT_MS`, `DGPP_CONSUMER_DEADLINE_S`,
    `DGPP_BUS_COMPLETION_TIMEOUT_MS`)."""

    rendezvous_s: float = Field(300.0, gt=0)
    collective_s: float = Field(600.0, gt=0)
    control_deadline_s: float = Field(120.0, gt=0)
    heartbeat_s: float = Field(1.0, gt=0)
    step_watchdog_s: float = Field(600.0, gt=0)
    load_s: float = Field(1800.0, gt=0)
    shutdown_s: float = Field(30.0, gt=0)


class PathsSection(_Section):
    """Where files live on every node. `models_dir` (e.g. the NFS mount of the weights) is
    searched first for the model: `Qwen/Qwen3-8B` is taken from `<models_dir>/Qwen3-8B` when that
    directory exists."""

    models_dir: str | None = None


class ResidentCacheSection(_Section):
    enabled: bool = True
    dir: str | None = None


class SpeculativeSection(_Section):
    """Speculative decoding. `ngram` drafts up to `depth` tokens per step by looking the last
    `ngram_max` .. `ngram_min` tokens up in the request's own history (prompt lookup: strong for
    agents and edits that repeat their context) and verifies them in one forward; the output is
    the same as without it."""

    method: Literal["off", "ngram"] = "off"
    depth: int = Field(4, ge=1, le=16)
    ngram_max: int = Field(4, ge=1, le=16)
    ngram_min: int = Field(2, ge=1, le=16)

    @model_validator(mode="after")
    def _ngram_range(self) -> SpeculativeSection:
        if self.ngram_min > self.ngram_max:
            raise ValueError(
                f"ngram_min ({self.ngram_min}) must not exceed ngram_max ({self.ngram_max})"
            )
        return self


class Deployment(_Section):
    model: str = Field(min_length=1)  # checkpoint dir, HF repo id, or "default"
    world_size: int = Field(1, ge=1)
    engine: EngineSection = Field(default_factory=EngineSection)
    http: HttpSection = Field(default_factory=HttpSection)
    rendezvous: RendezvousSection = Field(default_factory=RendezvousSection)
    timeouts: TimeoutsSection = Field(default_factory=TimeoutsSection)
    resident_cache: ResidentCacheSection = Field(default_factory=ResidentCacheSection)
    paths: PathsSection = Field(default_factory=PathsSection)
    speculative: SpeculativeSection = Field(default_factory=SpeculativeSection)


def parse_deployment(
    raw: Any, source: str = "deployment", api_key_given: bool = False
) -> Deployment:
    """Validate plain data; `ConfigError` names every bad key's path and what it allows.
    `api_key_given`: a key comes from elsewhere than the file (`dgpp serve --api-key`)."""
    try:
        return Deployment.model_validate(raw, context={"api_key_given": api_key_given})
    except ValidationError as err:
        problems = [_describe(error) for error in err.errors()]
        raise ConfigError(f"{source} is invalid: " + "; ".join(problems)) from None


def _describe(error: Any) -> str:
    path = ".".join(str(part) for part in error["loc"]) or "(top level)"
    if error["type"] == "extra_forbidden":
        return f"{path}: unknown key"
    if error["type"] == "missing":
        return f"{path}: required"
    detail = error["msg"]
    if error["type"] == "value_error" and isinstance(error.get("input"), dict):
        return f"{path}: {detail}"  # a whole section's rule: its message names the keys
    if error["type"] == "literal_error":
        detail = f"must be one of {error['ctx']['expected']}"
    return f"{path}: {detail} (got {error.get('input')!r})"


def engine_config(deployment: Deployment) -> EngineConfig:
    spec = deployment.speculative
    return EngineConfig(
        model=deployment.model,
        resident_cache=deployment.resident_cache.enabled,
        resident_cache_dir=deployment.resident_cache.dir,
        speculative=spec.method,
        spec_depth=spec.depth,
        spec_ngram_max=spec.ngram_max,
        spec_ngram_min=spec.ngram_min,
        **deployment.engine.model_dump(),
    )


def server_config(deployment: Deployment, api_key: str | None = None) -> ServerConfig:
    """The HTTP server's settings, with the keys read from the files the deployment names
    (`api_key` from the command line wins over `http.api_key_file`)."""
    http = deployment.http
    names = tuple(http.served_model_names)
    if all(is_pattern(name) for name in names):  # patterns only (or none): report the model's
        names = (default_served_name(deployment.model), *names)
    if api_key is not None:
        api_key = check_key(api_key, "--api-key")
    elif http.api_key_file:
        api_key = read_key_file(http.api_key_file, "http.api_key_file")
    admin_key = None
    if http.admin_key_file:
        admin_key = read_key_file(http.admin_key_file, "http.admin_key_file")
    return ServerConfig(
        host=http.host,
        port=http.port,
        api_key=api_key,
        admin_key=admin_key,
        metrics_require_key=http.metrics_require_key,
        served_model_names=names,
        default_max_tokens=http.default_max_tokens,
        max_tokens_policy=http.max_tokens_policy,
        max_body_bytes=http.max_body_bytes,
        queue_limit=http.queue_limit,
        responses_store_size=http.responses_store_size,
        responses_store_ttl_s=http.responses_store_ttl_s,
        stats_log_interval_s=http.stats_log_interval_s,
        default_chat_template_kwargs=dict(http.default_chat_template_kwargs),
        generation_config=http.generation_config,
        tool_call_parser=http.tool_call_parser,
    )


def default_served_name(model: str) -> str:
    return "default" if model == "default" else Path(model).name or model


def world_timeouts(deployment: Deployment) -> WorldTimeouts:
    return WorldTimeouts(**deployment.timeouts.model_dump())


def world_spec(deployment: Deployment, rank: int, timeouts: WorldTimeouts) -> WorldSpec:
    rendezvous = deployment.rendezvous
    backend = rendezvous.backend
    if backend == "auto":
        backend = "nccl" if deployment.engine.device.startswith("cuda") else "gloo"
    return WorldSpec(
        rank=rank,
        head=rendezvous.head,
        port=rendezvous.port,
        world_size=deployment.world_size if rank == 0 else None,
        backend=backend,
        timeouts=timeouts,
    )


def checkpoint_of(deployment: Deployment) -> Path:
    """The checkpoint directory this deployment serves (`paths.models_dir` first)."""
    from dgpp.appliance.model_store import resolve_model

    if deployment.paths.models_dir is not None and deployment.model != "default":
        local = Path(deployment.paths.models_dir).expanduser() / Path(deployment.model).name
        if local.is_dir():
            return local
    return resolve_model(deployment.model)
