"""The Models page's side models (issue 67): their state as rank 0 reports it (`GET /v1/models`),
and POST /models/side/{name}/load|unload, the buttons, through rank 0's admin routes. The main
model is switched on this page as before, never unloaded from here."""

from __future__ import annotations

import time
from typing import Any, Literal
from urllib.parse import quote

from fastapi import APIRouter
from fastapi.responses import RedirectResponse

from dgpp.engine.errors import ConfigError
from dgpp.engine.planning.memory_plan import format_bytes
from dgpp.webui.core.console import Console
from dgpp.webui.routes.deps import CSRF_CHECKED, LOGGED_IN, ConsoleDep, EngineFor
from dgpp.webui.switch.switcher import EngineFactory

router = APIRouter(dependencies=LOGGED_IN)


async def side_rows(console: Console, engine_for: EngineFactory) -> dict[str, Any]:
    """The page's side-model section: a row per side model the deployment names, with what the
    engine says of it (`state` unknown when it does not answer)."""
    try:
        deployment = console.store.current()
    except ConfigError:
        return {"side_models": [], "side_reachable": True}
    if not deployment.side_models:
        return {"side_models": [], "side_reachable": True}
    cards = await engine_for(deployment).side_models()
    known = {card.get("id"): card for card in cards or []}
    rows = []
    for side in deployment.side_models:
        card = known.get(side.name, {})
        idle = card.get("idle_s")
        rows.append(
            {
                "name": side.name,
                "kind": side.kind,
                "model": side.model,
                "aliases": ", ".join(side.aliases),
                "load": side.load,
                "state": card.get("state", "unknown"),
                "memory": format_bytes(card["memory_bytes"]) if card.get("memory_bytes") else "-",
                "in_flight": card.get("in_flight", 0),
                "last_use": "never" if idle is None else f"{idle:.0f} s ago",
                "counts": f"{card.get('loads', 0)} / {card.get('unloads', 0)} / "
                f"{card.get('crashes', 0)}",
                "error": card.get("error") or "",
            }
        )
    return {"side_models": rows, "side_reachable": cards is not None, "side_time": time.time()}


@router.post("/models/side/{name}/{action}", response_model=None, dependencies=CSRF_CHECKED)
async def side_action(
    name: str, action: Literal["load", "unload"], console: ConsoleDep, engine_for: EngineFor
) -> RedirectResponse:
    """Load or stop a side model now; back to the Models page with rank 0's answer."""
    deployment = console.store.current()
    if name not in {side.name for side in deployment.side_models}:
        message = f"{name!r} is not a side model of the current deployment"
    else:
        ok, detail = await engine_for(deployment).side_action(name, action)
        if not ok and detail.startswith("no answer within"):  # a load goes on past the wait
            ok, detail = True, f"{action} under way ({detail})"
        message = f"{name}: {detail}" if ok else f"{name}: {action} failed: {detail}"
    return RedirectResponse(f"/models?side_message={quote(message)}#side-models", status_code=303)
