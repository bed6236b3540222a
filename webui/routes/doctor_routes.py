"""GET /api/doctor: `dgpp doctor`'s findings for the node the console runs on (the overview's
Node health panel), with the head's URL and API key the console already knows."""

from __future__ import annotations

import asyncio
import socket
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request

from dgpp.appliance.doctor.report import Options
from dgpp.engine.errors import ConfigError
from dgpp.webui.core.console import Console
from dgpp.webui.deployments.store import engine_target
from dgpp.webui.monitor.node_health import NodeDoctor
from dgpp.webui.routes.deps import LOGGED_IN, ConsoleDep, get_console

router = APIRouter(dependencies=LOGGED_IN)


def get_node_doctor(request: Request) -> NodeDoctor:
    """The console's doctor; tests replace it through `dependency_overrides` (a recorded node)."""
    return get_console(request).doctor


DoctorDep = Annotated[NodeDoctor, Depends(get_node_doctor)]


def doctor_options(console: Console) -> Options:
    """The engine check asks the head this console watches; without a deployment that resolves,
    the doctor's own default (this node's deployment file, else the default port)."""
    try:
        target = engine_target(console.store.current(), console.config.engine_url)
    except (ConfigError, OSError):
        return Options(url=console.config.engine_url)
    return Options(url=target.url, api_key=target.api_key)


@router.get("/api/doctor")
async def node_doctor(
    console: ConsoleDep, doctor: DoctorDep, fresh: bool = False
) -> dict[str, Any]:
    """The report (kept a minute; `fresh` runs the checks again) and this node's host name."""
    report = await asyncio.to_thread(doctor.report, doctor_options(console), fresh)
    return {**report.as_json(), "hostname": socket.gethostname()}
