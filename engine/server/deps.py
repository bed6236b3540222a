"""Typed dependencies shared by the routers; tests replace them through `dependency_overrides`."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from dgpp.engine.server.state import ServerState


def get_state(request: Request) -> ServerState:
    return request.app.state.dgpp


State = Annotated[ServerState, Depends(get_state)]
