"""POST /admin/models/{name}/load and /unload: a side model loaded or stopped now (the console's
buttons; the admin key, as every /admin route). The main model is never unloaded here."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request

from dgpp.engine.server.core.errors import APIError
from dgpp.engine.server.core.side_proxy import SideRouter

router = APIRouter()


def _router_for(request: Request, name: str) -> SideRouter:
    sides: SideRouter | None = request.app.state.dgpp_sides
    known = [card["id"] for card in sides.listing()] if sides is not None else []
    if sides is None or name not in known:
        raise APIError(
            404,
            f"no side model named {name!r}; side models: {', '.join(known) or 'none'} (the "
            "main model is not unloaded from here)",
            code="model_not_found",
            param="name",
        )
    return sides


def _card(sides: SideRouter, name: str) -> dict[str, Any]:
    return next(card for card in sides.listing() if card["id"] == name)


@router.post("/admin/models/{name}/load")
async def load_side_model(name: str, request: Request) -> dict[str, Any]:
    sides = _router_for(request, name)
    await sides.load(name)
    return _card(sides, name)


@router.post("/admin/models/{name}/unload")
async def unload_side_model(name: str, request: Request) -> dict[str, Any]:
    sides = _router_for(request, name)
    await asyncio.to_thread(sides.unload, name)  # waits for its server to stop
    return _card(sides, name)
