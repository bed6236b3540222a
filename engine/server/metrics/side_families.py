"""The Prometheus families of side models (`core.side_proxy`): each one's state, requests in
flight, memory it may take, and its loads, unloads and crashes, labelled by the side model's name
(`model_name`, as the main model's families are)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

STATES = ("unloaded", "loading", "loaded", "failed")


def side_families(cards: list[dict[str, Any]]) -> Iterator[Metric]:
    """From the side models' /v1/models cards (`SideRouter.listing`)."""
    if not cards:
        return
    state = GaugeMetricFamily(
        "dgpp:side_model_state",
        "1 for the side model's current state (unloaded, loading, loaded, failed), else 0.",
        labels=["model_name", "state"],
    )
    gauges = {
        "in_flight": GaugeMetricFamily(
            "dgpp:side_model_requests_in_flight", "Requests the side model is answering now.",
            labels=["model_name"],
        ),
        "memory_bytes": GaugeMetricFamily(
            "dgpp:side_model_memory_bytes", "Memory the side model may take when loaded.",
            labels=["model_name"],
        ),
    }  # fmt: skip
    counters = {
        key: CounterMetricFamily(f"dgpp:side_model_{key}", doc, labels=["model_name"])
        for key, doc in (
            ("loads", "Loads of the side model that reached serving."),
            ("unloads", "Stops of the side model: idle, making room, or asked to."),
            ("crashes", "Exits of the side model's server that nobody asked for."),
        )
    }
    for card in cards:
        name = card["id"]
        for each in STATES:
            state.add_metric([name, each], 1.0 if card["state"] == each else 0.0)
        for key, family in [*gauges.items(), *counters.items()]:
            family.add_metric([name], float(card[key]))
    yield state
    yield from gauges.values()
    yield from counters.values()
