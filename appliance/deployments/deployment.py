"""The deployment file: one strict, typed model that every part of dgpp is configured from.

Unknown keys and wrong types are refused with the key's path and what is allowed. Pure functions
turn a deployment into the engine's, the server's and the world's frozen configurations.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    Field,
    ValidationError,
    ValidationInfo,
    model_validator,
)

from dgpp.appliance.common.paths import expanded
from dgpp.appliance.deployments.http_keys import check_key, read_key_file
from dgpp.appliance.deployments.knob_schema import Section, knob_values, section_model
from dgpp.appliance.deployments.side_models import SideModel, check_side_models
from dgpp.engine.configuration.engine_config import EngineConfig
from dgpp.engine.configuration.knobs import knobs_of
from dgpp.engine.distributed.world_spec import WorldSpec, WorldTimeouts
from dgpp.engine.errors import ConfigError
from dgpp.engine.sampling.sampling_params import PRIORITY_RANGE
from dgpp.engine.server.core.config import ServerConfig, is_pattern
from dgpp.engine.server.core.priority import KeyPolicy

_Section = Section

EngineSection = section_model("EngineSection", "engine", EngineConfig)
SpeculativeSection = section_model(
    "SpeculativeSection",
    "speculative",
    EngineConfig,
    doc="Speculative decoding (docs/speculative.md): `ngram` drafts up to `depth` tokens per step "
    "by looking the last `ngram_max` .. `ngram_min` tokens up in the request's own history, "
    "`mtp` one token per step with the checkpoint's multi-token-prediction layer (DeepSeek-V3, "
    "GLM-4.5); the target verifies them in one forward; the output is the same as without it.",
)
ResidentCacheSection = section_model("ResidentCacheSection", "resident_cache", EngineConfig)
TimeoutsSection = section_model(
    "TimeoutsSection",
    "timeouts",
    WorldTimeouts,
    doc="Every deadline of the runtime (see `WorldTimeouts`); also overridable from the "
    "environment by the CLI (`DGPP_BOUNDARY_TIMEOUT_MS`, `DGPP_CONSUMER_DEADLINE_S`, "
    "`DGPP_BUS_COMPLETION_TIMEOUT_MS`).",
)


class ApiKeyEntry(_Section):
    """An API key beside `api_key_file`, for one kind of client (a CI agent's, a batch job's):
    its requests' default `priority` (lower runs first) and `priority_limit`, the most urgent
    priority they may ask for (a request asking for more runs at the limit, logged)."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    key_file: str = Field(min_length=1)
    priority: int = Field(0, ge=PRIORITY_RANGE[0], le=PRIORITY_RANGE[1])
    priority_limit: int | None = Field(None, ge=PRIORITY_RANGE[0], le=PRIORITY_RANGE[1])

    @model_validator(mode="after")
    def _default_within_limit(self) -> ApiKeyEntry:
        if self.priority_limit is not None and self.priority < self.priority_limit:
            raise ValueError(
                f"api key {self.name!r}: priority {self.priority} is more urgent than its own "
                f"priority_limit {self.priority_limit} (lower runs first)"
            )
        return self


class _HttpSettings(_Section):
    """The `http:` section's settings that are no `ServerConfig` knob: where the keys are."""

    api_key_file: str | None = None  # the key stays out of the deployment (and of bundles)
    admin_key_file: str | None = None  # /admin/*; without one they answer on loopback only
    api_keys: list[ApiKeyEntry] = Field(default_factory=list)  # more keys, each its priority
    # A host other machines can reach needs api_key_file, unless this says serving them
    # without a key is meant (logged as a warning, shown on the console).
    allow_unauthenticated: bool = False

    @model_validator(mode="after")
    def _reachable_needs_a_key(self, info: ValidationInfo) -> _HttpSettings:
        key_given = bool(info.context and info.context.get("api_key_given")) or bool(self.api_keys)
        names = [entry.name for entry in self.api_keys]
        if len(set(names)) < len(names):
            raise ValueError(f"api_keys: each key needs its own name, got {names}")
        host = getattr(self, "host", "127.0.0.1")
        if is_loopback(host) or self.api_key_file or key_given or self.allow_unauthenticated:
            return self
        raise ValueError(
            f"host {host!r} lets other machines reach the API, and no api_key_file is "
            "set: name a file holding the key (http.api_key_file), bind 127.0.0.1, or set "
            "http.allow_unauthenticated: true to serve the network without a key"
        )


HttpSection = section_model("HttpSection", "http", ServerConfig, base=_HttpSettings)


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


class PathsSection(_Section):
    """Where files live on every node. `models_dir` (e.g. the NFS mount of the weights) is
    searched first for the model: `Qwen/Qwen3-8B` is taken from `<models_dir>/Qwen3-8B` when that
    directory exists."""

    models_dir: str | None = None


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
    side_models: list[SideModel] = Field(default_factory=list, max_length=16)
    # What the side models of a node may take together; a load past it stops the least
    # recently used idle one first. Unset: no bound (each still within its own memory_gib).
    side_memory_gib: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _side_models_fit_the_world(self) -> Deployment:
        names = [name for name in self.http.served_model_names if name]
        main = [*names, default_served_name(self.model)]
        check_side_models(self.side_models, main, self.world_size)
        return self


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
    elif error["type"] == "string_pattern_mismatch":
        detail = pattern_detail(path, detail)
    return f"{path}: {detail} (got {error.get('input')!r})"


KNOB_AT = {
    each.deployment: each
    for cls in (EngineConfig, ServerConfig, WorldTimeouts)
    for each in knobs_of(cls)
    if each.deployment is not None
}


def pattern_detail(path: str, detail: str) -> str:
    """What a knob with a pattern accepts, in the knob's words (pydantic shows the regex)."""
    knob = KNOB_AT.get(path)
    return f"must be {knob.allowed}" if knob is not None and knob.allowed else detail


def engine_config(deployment: Deployment) -> EngineConfig:
    return EngineConfig(model=deployment.model, **knob_values(deployment, EngineConfig))


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
    knobs = knob_values(deployment, ServerConfig) | {"served_model_names": names}
    policies = tuple(
        KeyPolicy(
            entry.name,
            read_key_file(entry.key_file, f"http.api_keys[{entry.name}].key_file"),
            entry.priority,
            entry.priority_limit,
        )
        for entry in http.api_keys
    )
    return ServerConfig(api_key=api_key, admin_key=admin_key, api_keys=policies, **knobs)


def default_served_name(model: str) -> str:
    return "default" if model == "default" else Path(model).name or model


def world_timeouts(deployment: Deployment) -> WorldTimeouts:
    return WorldTimeouts(**knob_values(deployment, WorldTimeouts))


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
    from dgpp.appliance.models.store import resolve_model

    if deployment.paths.models_dir is not None and deployment.model != "default":
        local = expanded(deployment.paths.models_dir, "paths.models_dir")
        local = local / Path(deployment.model).name
        if local.is_dir():
            return local
    return resolve_model(deployment.model)
