"""Settings of the HTTP server (the engine's knobs live in `EngineConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 18080
    api_key: str | None = None  # every route but OPEN_PATHS needs it
    admin_key: str | None = None  # /admin/* need it; without one they answer on loopback only
    metrics_require_key: bool = False  # /metrics needs the API key too
    served_model_names: tuple[str, ...] = ()  # empty: the model reference's last path part
    # Agents often omit max_tokens; a tiny default leaves them with empty answers. None means
    # "up to the context limit", capped to what is left of the context after the prompt.
    default_max_tokens: int | None = 8192
    # max_tokens beyond what the context leaves after the prompt: "clamp" it to that room
    # (finish reason length), or "reject" the request (context_length_exceeded).
    max_tokens_policy: str = "clamp"
    max_body_bytes: int = 32 * 1024 * 1024
    queue_limit: int = 256
    # Responses API answers kept for previous_response_id and GET /v1/responses/{id}.
    responses_store_size: int = 1024
    responses_store_ttl_s: float = 3600.0
    keepalive_interval_s: float = 10.0
    stats_log_interval_s: float = 10.0  # the periodic stats log line; 0 turns it off
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # "auto": settings a request leaves out come from the checkpoint's generation_config.json
    # (as vLLM's --generation-config auto); "none": the OpenAI/Anthropic defaults.
    generation_config: str = "auto"
    # How the model writes tool calls and reasoning (output_format.py): "auto" tells it from the
    # chat template; "hermes", "glm45", "deepseek_v3", "harmony" or "qwen3_coder" name it.
    tool_call_parser: str = "auto"


PATTERN_CHARACTERS = frozenset("*?[")


def is_pattern(name: str) -> bool:
    """Whether a served name is a shell-style pattern (fnmatch) rather than a name."""
    return not PATTERN_CHARACTERS.isdisjoint(name)


def concrete_names(names: tuple[str, ...]) -> tuple[str, ...]:
    """The names that are not patterns, in order (the whole tuple when every one is)."""
    return tuple(n for n in names if not is_pattern(n)) or names
