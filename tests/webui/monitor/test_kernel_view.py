"""The Kernels panel's shape from `/v1/metrics`: a fallback with its reason and the twin's hint,
the cases as text, the all-reduce figures, a CPU rank's note, and whatever else an engine
sends as a note, never an error."""

from __future__ import annotations

from typing import Any

import pytest

from dgpp.webui.monitor.kernel_view import CPU_NOTE, FALLBACK_HINT, kernel_warning, kernels_view
from tests.webui.fakes import PTXAS_REASON, SELF_CHECK


def test_a_fallback_has_its_reason_and_the_cases_and_allreduce_read_as_text() -> None:
    view = kernels_view(SELF_CHECK)
    assert [(row["name"], row["state"], row["reason"]) for row in view["kernels"]] == [
        ("cuda_graphs", "ok", ""),
        ("paged_attention", "fallback", PTXAS_REASON),
        ("rms_norm", "ok", ""),
    ]
    assert view["fallbacks"] == ["paged_attention"]
    assert view["hint"] == FALLBACK_HINT == "the PyTorch twin serves: correct tokens, slower"
    assert view["note"] == f"1 of 3 fell back: {FALLBACK_HINT}"
    failed, passed = view["cases"]
    assert (failed["passed"], failed["seconds"], failed["error"]) == (
        False,
        "1.25 s",
        "did not run (tolerance 2e-02)",
    )
    assert failed["failure"] == PTXAS_REASON
    assert (passed["passed"], passed["seconds"], passed["error"]) == (
        True,
        "cached",
        "3.1e-03 of 2e-02",
    )
    assert view["allreduce"] == [
        {"size": "1 MiB", "time": "0.20 ms", "bus": "41.9 Gb/s"},
        {"size": "64 MiB", "time": "5.20 ms", "bus": "103.2 Gb/s"},
    ]
    warning = kernel_warning(view)
    assert warning is not None and "paged_attention fell back to the PyTorch twin" in warning


@pytest.mark.parametrize(
    ("metrics", "note"),
    [
        (None, "the engine is not serving: no self-check to show"),
        ({}, "the engine reports no kernel self-check (an engine older than it)"),
        ({"kernels": {}, "kernel_checks": [], "allreduce": []}, CPU_NOTE),
        ({"kernels": ["ok"]}, "the engine's `kernels` is not an object"),
        ({"kernels": {"rms_norm": "ok"}}, "all 1 passed their self-check"),
    ],
)
def test_every_other_body_is_a_note(metrics: dict[str, Any] | None, note: str) -> None:
    view = kernels_view(metrics)
    assert view["note"] == note
    assert kernel_warning(view) is None


def test_odd_entries_are_shown_not_raised() -> None:
    view = kernels_view(
        {
            "kernels": {"rms_norm": "skipped", "rope_store": "fallback"},
            "kernel_checks": ["odd", {"kernel": "rms_norm", "seconds": "x", "error": True}],
            "allreduce": [{"bytes": 512, "seconds": None}, 7],
        }
    )
    assert [(row["state"], row["reason"]) for row in view["kernels"]] == [
        ("unknown", "skipped"),
        ("fallback", "no reason given"),
    ]
    (case,) = view["cases"]
    assert (case["label"], case["seconds"], case["error"]) == (
        "-",
        "-",
        "did not run (tolerance -)",
    )
    assert view["allreduce"] == [{"size": "512 B", "time": "-", "bus": "-"}]
    assert (
        kernels_view({"kernels": {}, "allreduce": [{"bytes": 4 << 20}]})["allreduce"][0]["size"]
        == "4 MiB"
    )
