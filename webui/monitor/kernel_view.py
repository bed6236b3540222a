"""The overview's Kernels panel: rank 0's start-up kernel self-check and the world's all-reduce
bandwidth, shaped for the page from the `kernels`, `kernel_checks` and `allreduce` keys of its
`/v1/metrics` (docs/metrics.md). Whatever the engine sends, the panel gets rows and a note:
an older engine, a CPU rank or an odd value is a line of text, never an error."""

from __future__ import annotations

from typing import Any

FALLBACK_HINT = "the PyTorch twin serves: correct tokens, slower"
CPU_NOTE = "no self-check on this device (CPU)"
_UNITS = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def kernels_view(metrics: dict[str, Any] | None) -> dict[str, Any]:
    """`kernels`: one row per kernel (`name`, `state` ok, fallback or unknown, `reason`,
    `is_fallback`); `cases`: the self-check's cases as text; `allreduce`: the bandwidth
    figures as text; `note`: the panel's line when there are no rows or something to say;
    `fallbacks`: the names that fell back."""
    view: dict[str, Any] = {
        "kernels": [],
        "cases": [],
        "allreduce": [],
        "fallbacks": [],
        "note": "",
        "hint": FALLBACK_HINT,
    }
    if metrics is None:
        view["note"] = "the engine is not serving: no self-check to show"
        return view
    view["allreduce"] = _allreduce_rows(metrics.get("allreduce"))
    kernels = metrics.get("kernels")
    if kernels is None:
        view["note"] = "the engine reports no kernel self-check (an engine older than it)"
        return view
    if not isinstance(kernels, dict):
        view["note"] = "the engine's `kernels` is not an object"
        return view
    if not kernels:
        view["note"] = CPU_NOTE
        return view
    view["kernels"] = [_kernel_row(str(name), state) for name, state in sorted(kernels.items())]
    view["fallbacks"] = [row["name"] for row in view["kernels"] if row["is_fallback"]]
    view["cases"] = _case_rows(metrics.get("kernel_checks"))
    if view["fallbacks"]:
        view["note"] = f"{len(view['fallbacks'])} of {len(kernels)} fell back: {FALLBACK_HINT}"
    else:
        view["note"] = f"all {len(kernels)} passed their self-check"
    return view


def kernel_warning(view: dict[str, Any]) -> str | None:
    """The overview's warning line when a kernel fell back; None when none did."""
    fallbacks = view["fallbacks"]
    if not fallbacks:
        return None
    which = "kernel" if len(fallbacks) == 1 else "kernels"
    return (
        f"rank 0: the {which} {', '.join(fallbacks)} fell back to the PyTorch twin "
        "(correct tokens, slower); the reason is in the Kernels panel."
    )


def _kernel_row(name: str, state: Any) -> dict[str, Any]:
    text = str(state)
    if text == "ok":
        return {"name": name, "state": "ok", "reason": "", "is_fallback": False}
    if text.startswith("fallback"):
        reason = text.partition(":")[2].strip() or "no reason given"
        return {"name": name, "state": "fallback", "reason": reason, "is_fallback": True}
    return {"name": name, "state": "unknown", "reason": text, "is_fallback": False}


def _case_rows(cases: Any) -> list[dict[str, Any]]:
    rows = []
    for case in cases if isinstance(cases, list) else []:
        if not isinstance(case, dict):
            continue
        failure = str(case.get("failure") or "")
        rows.append(
            {
                "kernel": str(case.get("kernel", "-")),
                "label": str(case.get("label", "-")),
                "dtype": str(case.get("dtype", "-")),
                "seconds": _seconds(case.get("seconds")),
                "error": _error(case.get("error"), case.get("tolerance")),
                "failure": failure,
                "passed": not failure,
            }
        )
    return rows


def _allreduce_rows(entries: Any) -> list[dict[str, str]]:
    rows = []
    for entry in entries if isinstance(entries, list) else []:
        if not isinstance(entry, dict):
            continue
        seconds, rate = entry.get("seconds"), entry.get("bus_gbps")
        rows.append(
            {
                "size": _size(entry.get("bytes")),
                "time": f"{seconds * 1e3:.2f} ms" if _is_number(seconds) else "-",
                "bus": f"{rate:.1f} Gb/s" if _is_number(rate) else "-",
            }
        )
    return rows


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _seconds(value: Any) -> str:
    if not _is_number(value):
        return "-"
    return "cached" if value == 0 else f"{value:.2f} s"  # 0: read from the results cache


def _error(error: Any, tolerance: Any) -> str:
    limit = f"{tolerance:.0e}" if _is_number(tolerance) else "-"
    if not _is_number(error):
        return f"did not run (tolerance {limit})"
    return f"{error:.1e} of {limit}"


def _size(value: Any) -> str:
    if not _is_number(value):
        return "-"
    for unit, scale in _UNITS:
        if value >= scale:
            return f"{value / scale:g} {unit}"
    return f"{value:g} B"
