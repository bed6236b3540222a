"""Turns a validated API request into engine `SamplingParams`."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from dgpp.engine.errors import InvalidRequestError, check_context
from dgpp.engine.sampling.sampling_defaults import SamplingDefaults
from dgpp.engine.sampling.sampling_params import SamplingParams
from dgpp.engine.server.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
)
from dgpp.engine.server.pipeline.state import ServerState
from dgpp.engine.tokenization.tokenizer import check_token_ids

log = logging.getLogger(__name__)


def resolve_max_tokens(
    requested: int | None,
    num_prompt_tokens: int,
    state: ServerState,
    param: str,
    prompt_param: str = "prompt",
) -> int:
    """An explicit limit that fits is kept; one that does not is clamped to what the context
    leaves after the prompt, or refused, as `max_tokens_policy` says. A missing one becomes the
    server default, capped to that room. A prompt that leaves no room is always refused."""
    room = state.max_model_len - num_prompt_tokens
    check_context(num_prompt_tokens, state.max_model_len, prompt_param=prompt_param)
    if requested is None:
        default = state.config.default_max_tokens
        return room if default is None else min(default, room)
    if requested > room and state.config.max_tokens_policy == "clamp":
        return room
    check_context(num_prompt_tokens, state.max_model_len, requested, prompt_param, param)
    return requested


def _logit_bias(raw: dict[str, float] | None, vocab_size: int | None) -> dict[int, float] | None:
    """The bias by token id; ids past the vocabulary are refused here, before a stream starts
    (the engine refuses them too, for callers of its own API)."""
    if not raw:
        return None
    bias = {}
    for key, value in raw.items():
        try:
            bias[int(key)] = value
        except ValueError:
            raise InvalidRequestError(
                f"logit_bias keys must be token ids, got {key!r}", param="logit_bias"
            ) from None
    if vocab_size is not None:
        check_token_ids(list(bias), vocab_size, param="logit_bias")
    return bias


def pick(requested: float | None, model: float | None, api: float) -> float:
    """The request's value, else the checkpoint's recommendation, else the API's default."""
    if requested is not None:
        return requested
    return api if model is None else model


@dataclass(frozen=True)
class ApiSampling:
    """The sampling settings of a request, whichever API it came through; None means "not
    given" (the checkpoint's recommendation applies, else the API's default)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logit_bias: dict[str, float] | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    @classmethod
    def of(cls, request: SamplingFields) -> ApiSampling:
        """A Chat Completions or Completions request's settings."""
        stop = request.stop
        return cls(
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k,
            min_p=request.min_p,
            repetition_penalty=request.repetition_penalty,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            seed=request.seed,
            logit_bias=request.logit_bias,
            stop=tuple(stop if isinstance(stop, list) else [stop] if stop else []),
            stop_token_ids=tuple(request.stop_token_ids or ()),
            ignore_eos=request.ignore_eos,
            include_stop_str_in_output=request.include_stop_str_in_output,
            skip_special_tokens=request.skip_special_tokens,
        )


def sampling_params(
    request: ApiSampling,
    max_tokens: int,
    logprobs: int | None,
    seed_offset: int = 0,
    defaults: SamplingDefaults | None = None,
    grammar: str | None = None,
    vocab_size: int | None = None,
    **extra: Any,
) -> SamplingParams:
    """`seed_offset` gives each of `n` choices its own stream from one request seed; settings
    the request leaves out come from `defaults` (the checkpoint's), else the API defaults;
    `vocab_size` bounds the `logit_bias` ids; `extra` are further `SamplingParams` fields."""
    model = defaults or SamplingDefaults()
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=pick(request.temperature, model.temperature, 1.0),
        top_p=pick(request.top_p, model.top_p, 1.0),
        top_k=int(pick(request.top_k, model.top_k, 0)),
        min_p=pick(request.min_p, model.min_p, 0.0),
        seed=None if request.seed is None else request.seed + seed_offset,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        repetition_penalty=pick(request.repetition_penalty, model.repetition_penalty, 1.0),
        logit_bias=_logit_bias(request.logit_bias, vocab_size),
        stop=request.stop,
        stop_token_ids=request.stop_token_ids,
        ignore_eos=request.ignore_eos,
        include_stop_str_in_output=request.include_stop_str_in_output,
        logprobs=logprobs,
        skip_special_tokens=request.skip_special_tokens,
        grammar=grammar,
        **extra,
    )


def chat_max_tokens(request: ChatCompletionRequest) -> tuple[int | None, str]:
    """The chat request's output limit and the field it came from: `max_completion_tokens`
    (OpenAI's current name) over the deprecated `max_tokens` when a client sends both, as vLLM
    takes it (load generators such as guidellm do send both); the conflict is logged."""
    if request.max_completion_tokens is None:
        return request.max_tokens, "max_tokens"
    if request.max_tokens is not None and request.max_tokens != request.max_completion_tokens:
        log.info(
            "max_tokens %d and max_completion_tokens %d both set: max_completion_tokens applies",
            request.max_tokens,
            request.max_completion_tokens,
        )
    return request.max_completion_tokens, "max_completion_tokens"


def chat_logprobs(request: ChatCompletionRequest) -> int | None:
    if request.top_logprobs is not None and not request.logprobs:
        raise InvalidRequestError("top_logprobs requires logprobs=true", param="top_logprobs")
    return (request.top_logprobs or 0) if request.logprobs else None


def check_unsupported(request: CompletionRequest) -> None:
    """Refuse completion fields dgpp accepts in the schema but cannot honour, naming them."""
    if request.suffix:
        raise InvalidRequestError("suffix is not supported", param="suffix")
    if request.best_of is not None and request.best_of != request.n:
        raise InvalidRequestError("best_of other than n is not supported", param="best_of")
