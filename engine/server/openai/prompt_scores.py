"""Scoring a prompt through /v1/completions, as evaluation clients do (lm-evaluation-harness's
`local-completions`): `echo: true` with `logprobs: N` returns the prompt's tokens with their
log-probabilities (the first `null`, as OpenAI's legacy API and vLLM do) before the generated
ones, `max_tokens: 0` generates nothing, and vLLM's `prompt_logprobs: N` adds a
`prompt_logprobs` list to each choice (per position: the token's and the N best tokens'
`{logprob, rank, decoded_token}` by token id). The engine scores the prompt in its own prefill
(`SamplingParams.prompt_logprobs`). A streamed completion's echo stays the prompt's text (its
logprobs are the generated tokens'); `prompt_logprobs` and `max_tokens: 0` are not streamed."""

from __future__ import annotations

from typing import Any

from dgpp.engine.errors import InvalidRequestError
from dgpp.engine.sampling.sampler import TokenLogprobs
from dgpp.engine.scheduling.request import CompletionOutput, RequestOutput
from dgpp.engine.server.openai.bodies import token_text
from dgpp.engine.server.openai.protocol import CompletionRequest


def scoring(request: CompletionRequest) -> tuple[int | None, bool]:
    """(how many alternatives per prompt token the engine must score, or None; whether
    nothing is generated: `max_tokens: 0`)."""
    wanted = request.prompt_logprobs
    score_only = request.max_tokens == 0
    if request.stream:  # a stream's echo carries the prompt's text only, as before
        if wanted is not None or score_only:
            raise InvalidRequestError(
                "prompt_logprobs and max_tokens 0 are not supported with stream", param="stream"
            )
        return None, False
    if wanted is None and request.echo and request.logprobs is not None:
        wanted = request.logprobs
    return wanted, score_only


def choice_logprobs(
    tokenizer: Any, request: CompletionRequest, prompt: list[int], output: RequestOutput
) -> dict[str, Any] | None:
    """The choice's legacy `logprobs` object: the prompt's entries first when echoed."""
    completion = output.outputs[0]
    if request.logprobs is None:
        return None
    entries: list[TokenLogprobs | None] = []
    tokens = []
    if request.echo:
        scored = output.prompt_logprobs or (None,) * len(prompt)
        entries.extend(scored)
        tokens.extend(prompt)
    if request.max_tokens != 0 and completion.logprobs is not None:
        entries.extend(completion.logprobs)
        tokens.extend(entry.token_id for entry in completion.logprobs)
    texts, offsets, at = [], [], 0
    for token in tokens:
        text = token_text(tokenizer, token)
        texts.append(text)
        offsets.append(at)
        at += len(text)
    return {
        "tokens": texts,
        "token_logprobs": [None if e is None else e.logprob for e in entries],
        "top_logprobs": [
            None if e is None else {token_text(tokenizer, t): lp for t, lp in e.top}
            for e in entries
        ],
        "text_offset": offsets,
    }


def vllm_prompt_logprobs(tokenizer: Any, output: RequestOutput) -> list[Any] | None:
    """vLLM's `prompt_logprobs`: None for the first token, then per token a dict by token id
    (its own and the best ones) of `{logprob, rank, decoded_token}`."""
    if output.prompt_logprobs is None:
        return None
    result: list[Any] = []
    for entry in output.prompt_logprobs:
        if entry is None:
            result.append(None)
            continue
        ranks = {token: rank for rank, (token, _) in enumerate(entry.top, 1)}
        found = {entry.token_id: (entry.logprob, entry.rank), **{
            token: (value, ranks[token]) for token, value in entry.top if token != entry.token_id
        }}  # fmt: skip
        result.append(
            {
                str(token): {
                    "logprob": value,
                    "rank": rank,
                    "decoded_token": token_text(tokenizer, token),
                }
                for token, (value, rank) in found.items()
            }
        )
    return result


def generated(completion: CompletionOutput, score_only: bool) -> tuple[str, int]:
    """The choice's generated text and token count (none when only scoring)."""
    return ("", 0) if score_only else (completion.text, len(completion.token_ids))
