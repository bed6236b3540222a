"""OpenAI response bodies built from engine outputs."""

from __future__ import annotations

import json
from typing import Any

from dgpp.engine.errors import DgppError
from dgpp.engine.sampling.sampler import TokenLogprobs
from dgpp.engine.scheduling.request import CompletionOutput, RequestOutput
from dgpp.engine.server.core.errors import error_body, from_dgpp_error

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def usage(
    prompt_tokens: int, completion_tokens: int, reasoning_tokens: int = 0, cached_tokens: int = 0
) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": reasoning_tokens},
    }


def token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _entry(tokenizer: Any, token_id: int, logprob: float) -> dict[str, Any]:
    text = token_text(tokenizer, token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokenizer: Any, entries: tuple[TokenLogprobs, ...]) -> dict[str, Any]:
    return {
        "content": [
            {
                **_entry(tokenizer, entry.token_id, entry.logprob),
                "top_logprobs": [_entry(tokenizer, t, lp) for t, lp in entry.top],
            }
            for entry in entries
        ]
    }


def completion_logprobs(
    tokenizer: Any, entries: tuple[TokenLogprobs, ...], text_offset: int
) -> dict[str, Any]:
    tokens, offsets = [], []
    for entry in entries:
        token = token_text(tokenizer, entry.token_id)
        tokens.append(token)
        offsets.append(text_offset)
        text_offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [entry.logprob for entry in entries],
        "top_logprobs": [
            {token_text(tokenizer, t): lp for t, lp in entry.top} for entry in entries
        ],
        "text_offset": offsets,
    }


def finish_reason(completion: CompletionOutput) -> str | None:
    return None if completion.finish_reason == "abort" else completion.finish_reason


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


DONE = "data: [DONE]\n\n"


def stream_end(
    base: dict[str, Any],
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int,
    include_usage: bool,
) -> list[str]:
    """The end of a Chat Completions or Completions stream: the usage chunk when the client
    asked for it (`stream_options.include_usage`), then `[DONE]`."""
    if not include_usage:
        return [DONE]
    counts = usage(prompt_tokens, completion_tokens, cached_tokens=cached_tokens)
    return [sse({**base, "choices": [], "usage": counts}), DONE]


def sse_error(err: DgppError) -> str:
    """How an OpenAI stream ends on an error once its headers are sent: the error event, then
    `[DONE]`."""
    api = from_dgpp_error(err)
    return sse(error_body(api.message, api.type, api.code, api.param)) + DONE


def final(outputs: list[RequestOutput]) -> tuple[int, int]:
    """(prompt tokens, completion tokens) over the choices of one request."""
    prompt = len(outputs[0].prompt_token_ids) if outputs else 0
    return prompt, sum(len(o.outputs[0].token_ids) for o in outputs)
