"""GET /v1/metrics (JSON, behind the API key) and GET /metrics (Prometheus text, open).

Fields, names and units: docs/metrics.md.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Request, Response

from dgpp.engine.scheduling.stats import ClassLatency, EngineStats
from dgpp.engine.server.core.errors import APIError
from dgpp.engine.server.core.sessions import redacted
from dgpp.engine.server.core.side_proxy import side_get
from dgpp.engine.server.metrics import prometheus
from dgpp.engine.server.metrics.process_memory import MemoryReading, read_memory
from dgpp.engine.server.metrics.service import ServiceCounters, ServiceMetrics
from dgpp.engine.server.routes.deps import State

router = APIRouter()
SHOWN = 20  # sessions in /v1/metrics


@router.get("/v1/metrics", response_model=None)
async def metrics_json(
    request: Request, state: State, model: str | None = None
) -> dict[str, Any] | Response:
    """This server's metrics; with `model` naming a side model, that model's own (409 while it
    is not loaded: asking never loads it)."""
    if (side := await _side_metrics(request, model, "/v1/metrics")) is not None:
        return side
    state.check_model(model)
    metrics: ServiceMetrics = request.app.state.dgpp_metrics
    body = metrics_body(state.engine.stats(), metrics.counters())
    sides = request.app.state.dgpp_sides
    return {**body, "side_models": sides.listing() if sides is not None else []}


@router.get("/metrics", include_in_schema=False)
async def metrics_prometheus(request: Request, model: str | None = None) -> Response:
    if (side := await _side_metrics(request, model, "/metrics")) is not None:
        return side
    body = prometheus.render(request.app.state.dgpp_prometheus)
    return Response(body, media_type=prometheus.CONTENT_TYPE)


async def _side_metrics(request: Request, model: str | None, path: str) -> Response | None:
    """A side model's own answer at `path`, when `model` names one; None for this server's."""
    sides = request.app.state.dgpp_sides
    if model is None or sides is None or sides.side_for(model) is None:
        return None
    answer = await side_get(sides, model, path)
    if answer is None:
        raise APIError(409, f"side model {model!r} is not loaded", code="model_not_loaded")
    kind = answer.headers.get("content-type", "application/json")
    return Response(answer.content, status_code=answer.status_code, media_type=kind)


def _average(total: float, count: int) -> float | None:
    return total / count if count else None


def _snapshots(stats: EngineStats) -> dict[str, Any] | None:
    """Recurrent-state snapshots (hybrid models; None for others): held now, their bytes,
    cumulative saves, evictions and restores, restores by depth in tokens."""
    snap = stats.snapshots
    if snap is None:
        return None
    return {
        "capacity": stats.snapshot_capacity,
        "held": snap.held,
        "bytes": snap.bytes_held,
        "saved": snap.saved,
        "evicted": snap.evicted,
        "hits": snap.hits,
        "hits_by_depth_tokens": {
            str(depth * stats.block_size): count
            for depth, count in sorted(snap.hits_by_depth.items())
        },
    }


def _priorities(stats: EngineStats) -> dict[str, Any]:
    queues, classes = stats.queues_by_priority, stats.counters.priority_classes
    body = {}
    for label in sorted({*queues, *classes}, key=lambda name: (name == "other", _number(name))):
        latency = classes.get(label) or ClassLatency()
        body[label] = {
            **queues.get(label, {"waiting": 0, "running": 0}),
            "requests": latency.count,
            "queue_avg_s": _average(latency.queue_sum_s, latency.count),
            "ttft_avg_s": _average(latency.ttft_sum_s, latency.count),
            "itl_avg_s": _average(latency.itl_sum_s, latency.itl_count),
        }
    return body


def _number(label: str) -> int:
    return int(label) if label.lstrip("-").isdigit() else 0


def metrics_body(
    stats: EngineStats, service: ServiceCounters, memory: MemoryReading | None = None
) -> dict[str, Any]:
    """The `/v1/metrics` body; `memory` is read from this process now unless given."""
    counters, cache = stats.counters, stats.counters.prefix_cache
    spec = counters.spec_decode
    memory = memory if memory is not None else read_memory()
    return {
        "scheduler": {
            "running": stats.running,
            "waiting": stats.waiting,
            "prefilling": stats.prefilling,
            "kv_blocks_total": stats.kv_blocks_total,
            "kv_blocks_in_use": stats.kv_blocks_in_use,
            "kv_block_size": stats.block_size,
            "kv_tokens_total": stats.kv_blocks_total * stats.block_size,
            "tokens_generated": counters.tokens_generated,
            "prompt_tokens_total": counters.prompt_tokens_total,
            "prompt_tokens_computed": counters.prompt_tokens_computed,
            "decode_steps": counters.num_decode_steps,
            "layer_slice_steps": counters.num_layer_slices,
        },
        # The start-up self-check: each Triton kernel "ok" or "fallback: reason", CUDA graphs
        # too; every case with its first call's seconds (compile included) and its error.
        "kernels": dict(stats.kernels),
        "kernel_checks": list(stats.kernel_checks),
        # The world's all-reduce at its warm-up: [{bytes, seconds, bus_gbps (Gbit/s)}].
        "allreduce": list(stats.allreduce),
        "service": asdict(service),
        "memory": asdict(memory),
        "prefix_cache": {
            "enabled": stats.prefix_cache_enabled,
            "queries": cache.queries,
            "hits": cache.hits,
            "misses": cache.misses,
            "hit_tokens": cache.hit_tokens,
            "tokens_saved": cache.hit_tokens,
            "evictions": cache.evictions,
            "skipped_inserts": cache.skipped_inserts,
            "host_hit_tokens": cache.host_hit_tokens,
            "host_spilled_blocks": cache.host_spilled_blocks,
            "host_loaded_blocks": cache.host_loaded_blocks,
            "host_evicted_blocks": cache.host_evicted_blocks,
            "disk_hit_tokens": cache.disk_hit_tokens,
            "disk_blocks": cache.disk_blocks,
            "disk_saved_blocks": cache.disk_saved_blocks,
            "disk_unsaved_blocks": cache.disk_unsaved_blocks,
            "disk_fetched_blocks": cache.disk_fetched_blocks,
            "disk_failed_blocks": cache.disk_failed_blocks,
            "disk_dropped_blocks": cache.disk_dropped_blocks,
            "disk_read_bytes": cache.disk_read_bytes,
            "disk_read_seconds": round(cache.disk_read_seconds, 6),
            "min_tokens": stats.prefix_min_tokens,
            "ttft_avg_hit_s": _average(cache.ttft_hit_sum_s, cache.ttft_hit_count),
            "ttft_avg_miss_s": _average(cache.ttft_miss_sum_s, cache.ttft_miss_count),
            "state_snapshots": _snapshots(stats),
        },
        # What the interactive step policy predicts steps from (docs/engine.md): the decode-only
        # step, a prompt token's cost (plus per position it attends over), and a typical short
        # request's solo first-token step. None until the engine has run such steps.
        "step_model": dict(stats.step_model),
        "prompt_classes": {
            name: {
                "requests": latency.count,
                "queue_sum_s": latency.queue_sum_s,
                "ttft_sum_s": latency.ttft_sum_s,
                "queue_avg_s": _average(latency.queue_sum_s, latency.count),
                "ttft_avg_s": _average(latency.ttft_sum_s, latency.count),
            }
            for name, latency in counters.prompt_classes.items()
        },
        # By request priority (lower runs first): the queues now, and what finished requests
        # waited (arrival to first scheduled), their first token and their inter-token gap.
        "priorities": _priorities(stats),
        # The most recently seen agent sessions (ids shown as their key's name and a digest;
        # whole ids: GET /v1/sessions, /admin/sessions)
        "sessions": [{**row, "id": redacted(str(row["id"]))} for row in stats.sessions[:SHOWN]],
        "vision": {
            "requests": counters.vision.requests,
            "images": counters.vision.images,
            "tokens": counters.vision.tokens,
            "images_per_request": _average(counters.vision.images, counters.vision.requests),
            "encoded": counters.vision.encoded,
            "encoder_seconds": round(counters.vision.encoder_seconds, 6),
            "encoder_avg_s": _average(counters.vision.encoder_seconds, counters.vision.encoded),
            "encoder_cache_hits": counters.vision.cache_hits,
        },
        "spec_decode": {
            "method": stats.speculative,
            "depth": stats.spec_depth,
            "drafts": spec.drafts,
            "drafted": spec.draft_tokens,
            "accepted": spec.accepted_tokens,
            "acceptance_rate": _average(spec.accepted_tokens, spec.draft_tokens),
            "mean_accepted_length": _average(spec.accepted_tokens, spec.drafts),
            "drafts_per_step": _average(spec.drafts, counters.num_decode_steps),
            "per_position": list(spec.accepted_per_position),
        },
    }
