"""POST /v1/embeddings (OpenAI), /v1/rerank and /v2/rerank (the Cohere/Jina shape vLLM serves) and
/v1/score (vLLM's), on a pooling engine (`engine.kind` embed or rerank)."""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from dgpp.engine.errors import InvalidRequestError
from dgpp.engine.scheduling.step_pooling import embedding
from dgpp.engine.server.core.priority import request_priority
from dgpp.engine.server.openai.pooling_protocol import (
    MAX_INPUTS,
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
)
from dgpp.engine.server.pipeline import pooling
from dgpp.engine.server.pipeline.state import ServerState
from dgpp.engine.server.routes.deps import State, Tracker

router = APIRouter()


def _usage(prompts: list[list[int]]) -> dict[str, int]:
    tokens = sum(len(prompt) for prompt in prompts)
    return {"prompt_tokens": tokens, "total_tokens": tokens}


@router.post("/v1/embeddings", response_model=None)
async def embeddings(
    request: EmbeddingRequest, state: State, tracker: Tracker, client: Request
) -> JSONResponse:
    model = state.check_model(request.model)
    state.check_kind("embed", "POST /v1/embeddings")
    pooling.check_dimensions(state, request.dimensions)
    prompts = await asyncio.to_thread(
        pooling.embedding_prompts, state, request.input, request.input_type
    )
    _check_count(len(prompts), "input")
    priority = request_priority(state.config.api_keys, client, request.priority)
    outputs = await pooling.pool(
        state, tracker, prompts, f"embd-{uuid.uuid4().hex}", priority, client
    )
    data = [
        {
            "object": "embedding",
            "index": index,
            "embedding": pooling.encode(
                embedding(output.pooled or (), request.dimensions), request.encoding_format
            ),
        }
        for index, output in enumerate(outputs)
    ]
    body = {"object": "list", "data": data, "model": model, "usage": _usage(prompts)}
    return JSONResponse(body)


async def _scores(
    state: ServerState,
    tracker: Tracker,
    client: Request,
    pairs: list[tuple[str, str]],
    instruction: str | None,
    priority: int | None,
    prefix: str,
) -> tuple[list[float], list[list[int]]]:
    state.check_kind("rerank", f"POST {client.url.path}")
    _check_count(len(pairs), "documents")
    prompts = await asyncio.to_thread(pooling.rerank_prompts, state, pairs, instruction)
    ranked = request_priority(state.config.api_keys, client, priority)
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    outputs = await pooling.pool(state, tracker, prompts, request_id, ranked, client)
    return [(output.pooled or (0.0,))[0] for output in outputs], prompts


def _check_count(count: int, param: str) -> None:
    if count == 0:
        raise InvalidRequestError(f"{param} is empty", param=param)
    if count > MAX_INPUTS:
        raise InvalidRequestError(
            f"{param} has {count} items; at most {MAX_INPUTS} per request", param=param
        )


@router.post("/v1/rerank", response_model=None)
@router.post("/v2/rerank", response_model=None)
async def rerank(
    request: RerankRequest, state: State, tracker: Tracker, client: Request
) -> JSONResponse:
    model = state.check_model(request.model)
    texts = [doc if isinstance(doc, str) else doc.text for doc in request.documents]
    pairs = [(request.query, text) for text in texts]
    scores, prompts = await _scores(
        state, tracker, client, pairs, request.instruction, request.priority, "rerank"
    )
    order = sorted(range(len(scores)), key=lambda index: -scores[index])
    results = []
    for index in order[: request.top_n]:
        result: dict[str, object] = {"index": index, "relevance_score": scores[index]}
        if request.return_documents:
            result["document"] = {"text": texts[index]}
        results.append(result)
    body = {
        "id": f"rerank-{uuid.uuid4().hex}",
        "model": model,
        "usage": {"total_tokens": _usage(prompts)["total_tokens"]},
        "results": results,
    }
    return JSONResponse(body)


@router.post("/v1/score", response_model=None)
async def score(
    request: ScoreRequest, state: State, tracker: Tracker, client: Request
) -> JSONResponse:
    model = state.check_model(request.model)
    first, second = request.text_1, request.text_2
    seconds = [second] if isinstance(second, str) else second
    if isinstance(first, str):
        pairs = [(first, text) for text in seconds]
    elif len(first) == len(seconds):
        pairs = list(zip(first, seconds, strict=True))
    else:
        raise InvalidRequestError(
            f"text_1 has {len(first)} texts and text_2 {len(seconds)}; lists pair one to one",
            param="text_2",
        )
    scores, prompts = await _scores(
        state, tracker, client, pairs, request.instruction, request.priority, "score"
    )
    body = {
        "id": f"score-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": [
            {"index": index, "object": "score", "score": value}
            for index, value in enumerate(scores)
        ],
        "usage": _usage(prompts),
    }
    return JSONResponse(body)
