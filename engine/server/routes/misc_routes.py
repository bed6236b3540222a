"""GET /health, GET /v1/models[/{id}], POST /tokenize and /detokenize."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from dgpp.engine.errors import InvalidRequestError
from dgpp.engine.server.core.config import concrete_names
from dgpp.engine.server.core.errors import RETRY_AFTER_SECONDS
from dgpp.engine.server.openai.protocol import DetokenizeRequest, TokenizeRequest
from dgpp.engine.server.pipeline.chat_prompt import render_chat
from dgpp.engine.server.pipeline.state import ServerState
from dgpp.engine.server.routes.deps import Startup, State, current_state
from dgpp.engine.tokenization.tokenizer import check_token_ids

router = APIRouter()


@router.get("/health", response_model=None)
async def health(request: Request) -> JSONResponse:
    state = current_state(request)
    startup: Startup = request.app.state.dgpp_startup
    if state is None:
        body: dict[str, Any] = {"state": startup.phase, **startup.details}
        if startup.error:
            body["error"] = startup.error
        return JSONResponse(body, status_code=503, headers={"Retry-After": RETRY_AFTER_SECONDS})
    engine = state.engine
    body = {
        "state": "serving" if engine.is_running else "failed",
        "model": state.model_name,
        "uptime_s": round(time.time() - state.started_at, 1),
        **startup.details,
    }
    if engine.failure is not None:
        body["error"] = str(engine.failure)
    return JSONResponse(body, status_code=200 if engine.is_running else 503)


def _card(state: ServerState, name: str) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": int(state.started_at),
        "owned_by": "dgpp",
        "root": state.model_name,
        "max_model_len": state.max_model_len,
        "kind": state.kind,
        "state": "loaded",
    }


@router.get("/v1/models")
async def list_models(state: State, request: Request) -> dict[str, Any]:
    """The main model's names, then every side model with its state (`core.side_proxy`)."""
    names = concrete_names(state.served_model_names)
    sides = request.app.state.dgpp_sides
    listed = sides.listing() if sides is not None else []
    return {"object": "list", "data": [*(_card(state, name) for name in names), *listed]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, state: State, request: Request) -> dict[str, Any]:
    sides = request.app.state.dgpp_sides
    for card in sides.listing() if sides is not None else []:
        if card["id"] == model_id:
            return card
    state.check_model(model_id)
    return _card(state, model_id)


@router.post("/tokenize")
async def tokenize(request: TokenizeRequest, state: State) -> dict[str, Any]:
    if request.model is not None:
        state.check_model(request.model)
    if (request.prompt is None) == (request.messages is None):
        raise InvalidRequestError("give exactly one of prompt or messages", param="prompt")
    tokens = await asyncio.to_thread(_tokens, state, request)  # off the event loop
    return {"tokens": tokens, "count": len(tokens), "max_model_len": state.max_model_len}


def _tokens(state: ServerState, request: TokenizeRequest) -> list[int]:
    if request.messages is not None:
        kwargs = dict(state.config.default_chat_template_kwargs)
        return render_chat(
            state, request.messages, None, kwargs, request.add_generation_prompt, hint_system=False
        )
    return list(
        state.tokenizer(request.prompt, add_special_tokens=request.add_special_tokens).input_ids
    )


@router.post("/detokenize")
async def detokenize(request: DetokenizeRequest, state: State) -> dict[str, Any]:
    if request.model is not None:
        state.check_model(request.model)
    check_token_ids(request.tokens, state.engine.engine.model_config.vocab_size, param="tokens")
    return {"prompt": state.tokenizer.decode(request.tokens)}
