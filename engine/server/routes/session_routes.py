"""Agent sessions (`dgpp.engine.cache.sessions`): a key's own sessions listed and released
(`GET /v1/sessions`, `DELETE /v1/sessions/{id}`), and every key's for the admin key
(`GET /admin/sessions`, `DELETE /admin/sessions/{key}/{id}`, where the `/admin` guard applies).

A session is listed with the tokens its cached blocks hold per tier (blocks no request uses:
what an eviction could take), how long it has been idle, whether it expired (`session_ttl_s`),
and the share of its prompt tokens the cache gave. Releasing one makes its blocks anonymous
(given up first); its requests in flight finish as they are. A key never sees or releases
another key's sessions: those answer 404 as unknown ones do.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request

from dgpp.engine.server.core.errors import APIError
from dgpp.engine.server.core.sessions import bounded, key_name
from dgpp.engine.server.routes.deps import State

router = APIRouter()


def _rows(state: State) -> list[dict[str, Any]]:
    return list(state.engine.stats().sessions)


async def _release(state: State, session: str, shown: str) -> dict[str, Any]:
    if session not in {row["id"] for row in _rows(state)}:
        raise APIError(404, f"no session {shown!r} is known", code="session_not_found")
    await asyncio.to_thread(state.engine.release_session, session)
    return {"id": shown, "object": "session", "deleted": True}


@router.get("/v1/sessions")
async def list_sessions(state: State, client: Request) -> dict[str, Any]:
    scope = key_name(state.config.api_keys, client) + "/"
    rows = [
        {**row, "id": row["id"][len(scope) :]}
        for row in _rows(state)
        if row["id"].startswith(scope)
    ]
    return {"object": "list", "data": rows}


@router.delete("/v1/sessions/{session_id:path}")
async def delete_session(session_id: str, state: State, client: Request) -> dict[str, Any]:
    scope = key_name(state.config.api_keys, client)
    return await _release(state, f"{scope}/{bounded(session_id)}", session_id)


@router.get("/admin/sessions")
async def list_all_sessions(state: State) -> dict[str, Any]:
    return {"object": "list", "data": _rows(state)}


@router.delete("/admin/sessions/{session_id:path}")
async def delete_any_session(session_id: str, state: State) -> dict[str, Any]:
    return await _release(state, session_id, session_id)
