"""Settings of the HTTP server. Its knobs (`dgpp.engine.configuration.knobs`) are the deployment's
`http:` section, the `dgpp serve` server flags and the console's; the keys come from files the
deployment names (`dgpp.appliance.deployments.deployment.server_config`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from dgpp.engine.configuration.knobs import check_knobs, knob
from dgpp.engine.server.core.priority import KeyPolicy

ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
ToolCallParser = Literal[
    "auto",
    "hermes",
    "glm45",
    "deepseek_v3",
    "harmony",
    "qwen3_coder",
    "minimax_m2",
    "kimi_k2",
    "dsml",
]


@dataclass(frozen=True)
class ServerConfig:
    KNOB_SECTION: ClassVar[str] = "http"

    host: str = knob("127.0.0.1", "bind address")
    port: int = knob(18080, "HTTP port", ge=1, le=65535)
    uds: str | None = knob(
        None,
        "serve on this Unix socket instead of host:port (how a side model's server answers "
        "rank 0's front, which holds the keys)",
    )
    api_key: str | None = None  # every route but OPEN_PATHS needs it
    admin_key: str | None = None  # /admin/* need it; without one they answer on loopback only
    # Further API keys, each with its requests' default priority and limit (`core.priority`)
    api_keys: tuple[KeyPolicy, ...] = ()
    metrics_require_key: bool = knob(False, "/metrics needs the API key too (it is open otherwise)")
    served_model_names: tuple[str, ...] = knob(
        (),
        "names clients use for the model (the first is reported); a pattern such as claude-* "
        "answers to every matching name, * to any",
        label="Served names",
        group="api",
        flag="--served-model-name",
        when_unset="the model reference's last path part",
        live=True,
    )
    # Agents often omit max_tokens; a tiny default leaves them with empty answers.
    default_max_tokens: int | None = knob(
        8192,
        "max_tokens of a request that names none",
        unit="tokens",
        ge=1,
        when_unset="up to the context limit",
        live=True,
    )
    max_tokens_policy: Literal["clamp", "reject"] = knob(
        "clamp",
        "a max_tokens beyond what the context leaves after the prompt: clamp generates until "
        "the context is full (finish reason length); reject refuses the request",
        label="Over-long max_tokens",
        group="api",
        live=True,
    )
    max_body_bytes: int = knob(32 * 1024 * 1024, "largest request body", unit="bytes", ge=1024)
    queue_limit: int = knob(
        256,
        "waiting requests before 503 overloaded",
        label="Queue limit",
        group="api",
        ge=0,
        live=True,
    )
    side_load_wait_s: float = knob(
        120.0,
        "how long a request for an unloaded side model waits for its load before 503 with "
        "Retry-After (the load goes on)",
        label="Side model load wait",
        group="api",
        advanced=True,
        unit="s",
        ge=0.0,
    )
    responses_store_size: int = knob(
        1024,
        "Responses API answers kept in memory (previous_response_id, GET /v1/responses/{id})",
        ge=0,
    )
    responses_store_ttl_s: float = knob(
        3600.0, "how long a stored Responses API answer is kept", unit="s", gt=0.0
    )
    keepalive_interval_s: float = knob(
        10.0,
        "a stream with nothing to send gets a keep-alive comment this often",
        unit="s",
        gt=0.0,
        deployment=None,
        flag=None,
    )
    stats_log_interval_s: float = knob(
        10.0,
        "seconds between stats log lines (throughput, queues, KV use, prefix-cache hits), "
        "logged only after activity; 0 turns the log off",
        unit="s",
        ge=0.0,
        flag="--stats-log-interval",
    )
    default_chat_template_kwargs: dict[str, Any] = knob(
        None,
        'JSON object passed to the chat template, e.g. {"enable_thinking": false}; a '
        "request's chat_template_kwargs win",
        label="Chat-template kwargs",
        group="api",
        advanced=True,
        factory=dict,
        live=True,
    )
    default_reasoning_effort: ReasoningEffort | None = knob(
        None,
        "the reasoning effort of a request that names none (reasoning_effort, reasoning.effort, "
        "output_config.effort): the template's own kwarg where it has one, and a budget of "
        "reasoning tokens (none 0, minimal 256, low 1024, medium 4096, high 16384, xhigh 32768, "
        "max: up to three quarters of max_tokens, the cap every request has)",
        label="Default reasoning effort",
        group="api",
        advanced=True,
        when_unset="none given: reasoning up to three quarters of max_tokens",
        live=True,
    )
    generation_config: Literal["auto", "none"] = knob(
        "auto",
        "auto: sampling settings a request leaves out come from the checkpoint's "
        "generation_config.json (as vLLM does); none: the OpenAI/Anthropic defaults",
    )
    tool_call_parser: ToolCallParser = knob(
        "auto",
        "how the model writes tool calls and reasoning; auto tells it from the chat template",
    )

    image_min_pixels: int | None = knob(
        None,
        "vision-language models: an image with fewer pixels is scaled up to about this many "
        "(aspect kept; each 32x32 square is one vision token)",
        label="Image min pixels",
        group="api",
        advanced=True,
        unit="pixels",
        ge=1024,
        when_unset="the checkpoint's image processor's",
        live=True,
    )
    image_max_pixels: int | None = knob(
        None,
        "vision-language models: an image with more pixels is scaled down to about this many "
        "(the image-quality knob: fewer pixels, fewer vision tokens, a shorter prefill); a "
        "request's mm_processor_kwargs may ask for other bounds within these",
        label="Image max pixels",
        group="api",
        advanced=True,
        unit="pixels",
        ge=1024,
        when_unset="the checkpoint's image processor's",
        live=True,
    )
    max_images_per_request: int = knob(
        32,
        "images one request may carry",
        label="Images per request",
        group="api",
        advanced=True,
        ge=0,
        live=True,
    )
    image_url_fetch: bool = knob(
        False,
        "fetch http(s) image URLs (at most 20 MiB, within image_fetch_timeout_s); off: only "
        "data: URLs and base64 images are taken",
        label="Fetch image URLs",
        group="api",
        advanced=True,
        live=True,
    )
    image_fetch_timeout_s: float = knob(
        10.0, "how long fetching one image URL may take", unit="s", gt=0.0, live=True
    )
    image_coordinates: Literal["original", "model"] = knob(
        "original",
        "grounding boxes and points in answers: original maps the ones a model writes in the "
        "resized image's pixels back to the client's image (models that write 0-1000 "
        "coordinates need no mapping); model leaves them as written; a request's "
        "image_coordinates wins",
        label="Image coordinates",
        group="api",
        advanced=True,
        live=True,
    )

    def __post_init__(self) -> None:
        check_knobs(self, prefix="http.")


PATTERN_CHARACTERS = frozenset("*?[")


def is_pattern(name: str) -> bool:
    """Whether a served name is a shell-style pattern (fnmatch) rather than a name."""
    return not PATTERN_CHARACTERS.isdisjoint(name)


def concrete_names(names: tuple[str, ...]) -> tuple[str, ...]:
    """The names that are not patterns, in order (the whole tuple when every one is)."""
    return tuple(n for n in names if not is_pattern(n)) or names
