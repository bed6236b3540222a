"""Typed errors raised by the engine.

Every error a caller can cause derives from `DgppError` and carries a machine-readable `code` and,
where one input is at fault, the `param` that names it. The HTTP layer maps these onto OpenAI-style
error bodies in one handler; nothing else needs to inspect messages.
"""

import re


class DgppError(Exception):
    """Base of every error dgpp raises on purpose."""

    code: str = "internal_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequestError(DgppError, ValueError):
    """A request (prompt or sampling parameters) is malformed or out of range."""

    code = "invalid_request_error"


class ContextLengthExceededError(InvalidRequestError):
    """The prompt, or prompt plus the requested tokens, can never fit the context or the KV pool."""

    code = "context_length_exceeded"


def check_context(
    num_prompt: int,
    max_model_len: int,
    max_tokens: int | None = None,
    prompt_param: str = "prompt",
    limit_param: str = "max_tokens",
) -> None:
    """The one context-length check (every API and the offline engine): the prompt must leave
    at least one token to generate, and the prompt plus `max_tokens`, where given, must fit."""
    if num_prompt >= max_model_len:
        raise ContextLengthExceededError(
            f"the prompt has {num_prompt} tokens; this model's context is {max_model_len} "
            "tokens and at least one must be left to generate",
            param=prompt_param,
        )
    if max_tokens is not None and num_prompt + max_tokens > max_model_len:
        raise ContextLengthExceededError(
            f"prompt ({num_prompt} tokens) plus {limit_param} ({max_tokens}) exceeds this "
            f"model's context of {max_model_len} tokens",
            param=limit_param,
        )


class ModelLoadError(DgppError):
    """A checkpoint could not be found, read or understood."""

    code = "model_load_error"


class UnsupportedModelError(ModelLoadError):
    """The checkpoint's architecture is not in the model registry."""

    code = "unsupported_model"


class ConfigError(DgppError, ValueError):
    """An engine knob has a value the engine cannot run with."""

    code = "config_error"


def one_line(err: BaseException | None, limit: int = 160) -> str:
    """An exception as one short line for logs and status: its type and first line, without the
    C++ source location that torch.distributed puts in front ("[/path/pair.cc:553] ...")."""
    if err is None:
        return "unknown error"
    lines = str(err).strip().splitlines()
    text = re.sub(r"^\[[^\]]*:\d+\]\s*", "", lines[0] if lines else "")
    text = f"{type(err).__name__}: {text}"
    return text if len(text) <= limit else text[: limit - 1] + "…"
