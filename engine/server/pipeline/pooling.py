"""The pooling routes' prompts and runs: embedding inputs (text or token ids, with a
sentence-transformers prompt for their `input_type`), a decoder reranker's query/document prompts
(Qwen3-Reranker's template), each run as one engine request whose result is pooled
(`dgpp.engine.scheduling.step_pooling`), all at once so the engine batches them."""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import torch
from fastapi import Request

from dgpp.engine.errors import ContextLengthExceededError, InvalidRequestError
from dgpp.engine.sampling.sampling_params import SamplingParams
from dgpp.engine.scheduling.request import RequestOutput
from dgpp.engine.server.metrics.service import RequestTracker
from dgpp.engine.server.pipeline.generation import Job, run_to_completion
from dgpp.engine.server.pipeline.state import ServerState
from dgpp.engine.tokenization.tokenizer import check_token_ids

log = logging.getLogger(__name__)

# Qwen3-Reranker's prompt (its model card): the model answers "yes" or "no" after it.
RERANK_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    'and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n"
)
RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
# Names the NVIDIA and Cohere embedding APIs use for text that needs no prompt
PLAIN_INPUT_TYPES = ("document", "passage", "search_document")


@lru_cache(maxsize=8)
def sentence_prompts(checkpoint: Path) -> dict[str, str]:
    """The prompts a sentence-transformers checkpoint names (config_sentence_transformers.json),
    by name: Qwen3-Embedding's "query" is its instruction for queries."""
    path = checkpoint / "config_sentence_transformers.json"
    try:
        prompts = json.loads(path.read_text()).get("prompts") if path.is_file() else None
    except (OSError, ValueError, AttributeError) as err:
        log.warning("ignoring %s: %s", path, err)
        return {}
    if not isinstance(prompts, dict):
        return {}
    return {str(name): text for name, text in prompts.items() if isinstance(text, str)}


def embedding_prompts(
    state: ServerState, raw: str | list, input_type: str | None
) -> list[list[int]]:
    """Each input's token ids: text through the checkpoint's tokenizer (its special tokens, as
    the model was trained), after the prompt of `input_type`; ids as given, checked."""
    texts: Sequence[str | list[int]]
    if isinstance(raw, str):
        texts = [raw]
    elif raw and all(isinstance(item, int) for item in raw):
        texts = [raw]  # one input of token ids
    else:
        texts = raw
    if not texts:
        raise InvalidRequestError("input is empty", param="input")
    prefix = _input_prompt(state, input_type)
    prompts = []
    for number, text in enumerate(texts):
        if isinstance(text, str):
            ids = list(state.tokenizer(prefix + text).input_ids)
        else:
            if prefix:
                raise InvalidRequestError(
                    "input_type adds a prompt to text; token ids must carry it already",
                    param="input_type",
                )
            ids = list(text)
            check_token_ids(ids, state.engine.engine.model_config.vocab_size, "input")
        prompts.append(_fits(state, ids, number, "input"))
    return prompts


def _input_prompt(state: ServerState, input_type: str | None) -> str:
    if input_type is None:
        return ""
    prompts = sentence_prompts(state.engine.engine.checkpoint)
    if input_type in prompts:
        return prompts[input_type]
    if input_type in PLAIN_INPUT_TYPES:
        return ""
    known = sorted({*prompts, *PLAIN_INPUT_TYPES})
    raise InvalidRequestError(
        f"input_type {input_type!r} is not one this model names; known: {', '.join(known)}",
        param="input_type",
    )


def rerank_prompts(
    state: ServerState, pairs: Sequence[tuple[str, str]], instruction: str | None
) -> list[list[int]]:
    """Each (query, document) pair's prompt: a cross-encoder's pair encoding (its tokenizer's
    own special tokens and separator; `instruction` does not apply), or the decoder reranker's
    template."""
    prompts = []
    if state.engine.engine.model_config.is_encoder:
        if instruction:
            raise InvalidRequestError(
                "this reranker is a cross-encoder: it takes no instruction", param="instruction"
            )
        for number, (query, document) in enumerate(pairs):
            ids = state.tokenizer(query, document).input_ids
            prompts.append(_fits(state, list(ids), number, "documents"))
        return prompts
    task = instruction or DEFAULT_INSTRUCTION
    for number, (query, document) in enumerate(pairs):
        text = f"{RERANK_PREFIX}<Instruct>: {task}\n<Query>: {query}\n<Document>: {document}"
        ids = state.tokenizer(text + RERANK_SUFFIX, add_special_tokens=False).input_ids
        prompts.append(_fits(state, list(ids), number, "documents"))
    return prompts


def _fits(state: ServerState, ids: list[int], number: int, param: str) -> list[int]:
    if not ids:
        raise InvalidRequestError(f"{param} {number} is empty", param=param)
    room = state.max_model_len + state.engine.engine.model_config.is_encoder  # draws no token
    if len(ids) >= room:
        raise ContextLengthExceededError(
            f"{param} {number} has {len(ids)} tokens; this model's context is "
            f"{state.max_model_len} tokens",
            param=param,
        )
    return ids


async def pool(
    state: ServerState,
    tracker: RequestTracker,
    prompts: list[list[int]],
    request_id: str,
    priority: int,
    client: Request,
) -> list[RequestOutput]:
    """Every prompt's finished output (its `pooled` result), in order; run at once."""
    params = [SamplingParams(max_tokens=1, priority=priority)]
    jobs = [Job(prompt, params, f"{request_id}-{n}") for n, prompt in enumerate(prompts)]
    return [outputs[0] for outputs in await run_to_completion(state, tracker, jobs, client)]


def encode(values: list[float], encoding_format: str) -> list[float] | str:
    """An embedding as OpenAI sends it: floats, or base64 of little-endian float32 (what the
    official SDKs ask for and decode)."""
    if encoding_format == "float":
        return values
    raw = torch.tensor(values, dtype=torch.float32).numpy().astype("<f4").tobytes()
    return base64.b64encode(raw).decode("ascii")


def check_dimensions(state: ServerState, dimensions: int | None) -> None:
    """`dimensions` only where the model was trained for shorter embeddings (Matryoshka):
    config.json's `is_matryoshka` or `matryoshka_dimensions`, or Qwen3-Embedding's family."""
    if dimensions is None:
        return
    engine = state.engine.engine
    size = engine.model_config.hidden_size
    raw = engine.model_config.raw  # config.json as the engine read it
    listed = raw.get("matryoshka_dimensions")
    qwen3 = engine.model_config.architecture == "Qwen3ForCausalLM"
    trained = bool(raw.get("is_matryoshka")) or bool(listed) or qwen3
    if not trained:
        raise InvalidRequestError(
            "this model was not trained for shorter embeddings (Matryoshka); leave dimensions out",
            param="dimensions",
        )
    if dimensions > size or (isinstance(listed, list) and dimensions not in listed):
        allowed = listed if isinstance(listed, list) else f"1 to {size}"
        raise InvalidRequestError(
            f"dimensions {dimensions} is not one this model serves: {allowed}", param="dimensions"
        )
