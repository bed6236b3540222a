"""GET / (the overview page), GET /api/overview (what it refreshes from) and GET /api/history
(the chart series and the switches to mark on them)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import HTMLResponse

from dgpp.appliance.deployments.deployment import Deployment, is_loopback
from dgpp.appliance.deployments.files import deployment_id
from dgpp.engine.errors import ConfigError
from dgpp.webui.core.console import Console
from dgpp.webui.core.engine_address import foreign_engine_warning
from dgpp.webui.deployments.store import engine_target, served_names
from dgpp.webui.monitor.kernel_view import kernel_warning, kernels_view
from dgpp.webui.monitor.node_probe import NodesApi, NodesClient, local_node, node_view
from dgpp.webui.monitor.traffic_view import traffic_view
from dgpp.webui.routes.deps import (
    LOGGED_IN,
    Backend,
    ConsoleDep,
    CurrentSession,
    EngineFor,
    get_console,
)
from dgpp.webui.routes.pages import render
from dgpp.webui.switch.marks import rollback_banner, switch_events
from dgpp.webui.switch.switcher import EngineFactory

router = APIRouter(dependencies=LOGGED_IN)

NodesFactory = Callable[[Deployment], NodesApi]


def get_nodes_factory(request: Request) -> NodesFactory:
    """Rank 0's `GET /admin/nodes`; tests replace it through `dependency_overrides`."""
    config = get_console(request).config
    return lambda deployment: NodesClient(
        engine_target(deployment, config.engine_url), config.engine_timeout_s
    )


NodesFor = Annotated[NodesFactory, Depends(get_nodes_factory)]


def speculative_view(metrics: dict[str, Any] | None, deployment: Deployment) -> dict[str, Any]:
    """Whether speculative decoding is on: as the running engine reports it in `/v1/metrics`, or
    as the deployment configures it when the engine does not say (down, or an older engine)."""
    spec = (metrics or {}).get("spec_decode") or {}
    if "method" in spec:
        method, depth, source = str(spec["method"]), spec.get("depth"), "engine"
    else:
        configured = deployment.speculative
        method, depth, source = configured.method, configured.depth, "deployment"
    on = method != "off"
    text = f"{method}, depth {depth}" if on else "off"
    if source == "deployment":
        text += " (configured; the engine does not say)"
    empty = f"{text}: nothing drafted in this window" if on else "speculative decoding is off"
    return {"method": method, "depth": depth, "source": source, "text": text, "empty": empty}


def step_model_view(metrics: dict[str, Any] | None) -> dict[str, Any]:
    """The engine's step-time model (`/v1/metrics` "step_model") as one line: what the
    interactive step policy predicts every step from."""
    model = (metrics or {}).get("step_model") or {}
    decode, token = model.get("decode_step_s"), model.get("token_s")
    if decode is None or token is None:
        return {**model, "text": "not fitted yet: the engine has not run decode and prompt steps"}
    position = model.get("token_position_s") or 0.0
    text = f"decode step {decode * 1e3:.1f} ms, prompt token {token * 1e3:.2f} ms"
    if position:
        text += f" + {position * 1e9:.0f} ns per earlier position"
    if (solo := model.get("solo_short_s")) is not None:
        text += f"; a short request alone {solo * 1e3:.0f} ms"
    return {**model, "text": text}


async def overview(
    console: Console, backend: Backend, engine_for: EngineFactory, nodes_for: NodesFactory
) -> dict[str, Any]:
    """Deployment, health, ranks, every node's GPUs and CPU, rank 0's kernel self-check, the
    latest switch, and the rollback banner's content (None unless the last switch that ended
    was not kept)."""
    body: dict[str, Any] = {"time": time.time(), "backend": backend.kind}
    nodes = None
    metrics: dict[str, Any] | None = None
    try:
        deployment = console.store.current()
    except ConfigError as err:
        body["deployment"] = {"error": err.message, "file": str(console.store.path)}
        deployment = None
    if deployment is not None:
        body["deployment"] = {
            "id": deployment_id(deployment),
            "file": str(console.store.path),
            "model": deployment.model,
            "served_names": list(served_names(deployment)),
            "world_size": deployment.world_size,
            "device": deployment.engine.device,
            "kv_capacity": deployment.engine.kv_capacity,
        }
        health = await engine_for(deployment).health()
        body["health"] = {
            "status": health.status,
            "state": health.state,
            "serving": health.is_serving,
            "reason": health.reason,
            "details": health.body,
        }
        metrics = await engine_for(deployment).metrics() if health.is_serving else None
        body["speculative"] = speculative_view(metrics, deployment)
        body["step_model"] = step_model_view(metrics)
        if health.status is not None:
            nodes = await nodes_for(deployment).nodes()
    else:
        body["health"] = {"status": None, "state": "unknown", "serving": False, "reason": ""}
    ranks = await asyncio.to_thread(backend.status)
    now = time.time()
    body["ranks"] = [
        {**asdict(rank), "uptime_s": now - rank.started_at if rank.started_at else None}
        for rank in ranks
    ]
    fraction = console.config.clock_warning_fraction
    if nodes is not None:
        body["nodes"] = [node_view(node, fraction) for node in nodes]
        body["nodes_source"] = "engine"
    else:  # the engine is down: this node only (the console runs on the head)
        body["nodes"] = [await asyncio.to_thread(local_node, console.gpus, fraction)]
        body["nodes_source"] = "local"
    body["warnings"] = [warning for node in body["nodes"] for warning in node["warnings"]]
    body["kernels"] = kernels_view(metrics)
    body.update(traffic_view(metrics))
    if (warning := kernel_warning(body["kernels"])) is not None:
        body["warnings"].append(warning)
    if deployment is not None and (warning := exposure_warning(deployment)) is not None:
        body["warnings"].insert(0, warning)
    if deployment is not None and (
        warning := foreign_engine_warning(console.config, backend.kind, deployment)
    ):
        body["warnings"].insert(0, warning)
    latest = console.switcher.latest
    body["switch"] = latest.as_json() if latest is not None else None
    body["rollback"] = rollback_banner(list(console.switcher.history))
    return body


def exposure_warning(deployment: Deployment) -> str | None:
    """The deliberate choice `http.allow_unauthenticated` makes, shown on every overview."""
    http = deployment.http
    if not http.allow_unauthenticated or http.api_key_file or is_loopback(http.host):
        return None
    return (
        f"The API on {http.host}:{http.port} takes requests from other machines without a key "
        "(http.allow_unauthenticated); set http.api_key_file to require one."
    )


@router.get("/", response_class=HTMLResponse)
async def overview_page(
    request: Request,
    console: ConsoleDep,
    backend: Backend,
    engine_for: EngineFor,
    nodes_for: NodesFor,
    session: CurrentSession,
) -> HTMLResponse:
    data = await overview(console, backend, engine_for, nodes_for)
    return render(
        request,
        "overview.html",
        {"page": "overview", "data": data, "sample_interval_s": console.config.sample_interval_s},
        session,
    )


@router.get("/api/overview")
async def overview_json(
    console: ConsoleDep, backend: Backend, engine_for: EngineFor, nodes_for: NodesFor
) -> dict[str, Any]:
    return await overview(console, backend, engine_for, nodes_for)


@router.get("/api/history")
async def history(
    console: ConsoleDep,
    window_s: Annotated[float, Query(gt=0, le=30 * 86400)] = 3600.0,
    model: Annotated[str, Query(max_length=200)] = "",
) -> dict[str, Any]:
    """Columns of `model`'s last `window_s` seconds up to `now` (the charts' x range; "" the
    main model, else a side model's name), the switches that ended in it (`events`, drawn as
    markers), and the side models the history holds (`models`: the page's choice)."""
    now = time.time()
    series = await asyncio.to_thread(console.history.series, window_s, now, model)
    events = switch_events(list(console.switcher.history), now - window_s)
    models = await asyncio.to_thread(console.history.models)
    return {
        "window_s": window_s, "now": now, "model": model, "models": models,
        "series": series, "events": events,
    }  # fmt: skip
