"""What a running engine says of itself: its kernel self-check and all-reduce bandwidth, read
from the head's `GET /v1/metrics` (JSON, behind the API key).

`kernels` maps each Triton kernel to "ok" or "fallback: <reason>" (absent on engines older than
the self-check); `allreduce`, where a world measured it, lists {bytes, seconds, bus_gbps} with
the bus bandwidth in Gbit/s, the link's unit. No engine answering is a normal state: unknown,
never a failure.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import fields
from typing import Any

from dgpp.appliance.doctor.check import Check
from dgpp.appliance.doctor.probe import Probe
from dgpp.engine.server.core.config import ServerConfig

DEFAULT_PORT: int = next(f.default for f in fields(ServerConfig) if f.name == "port")
DEPLOYMENT_FILE = "/etc/dgpp/deployment.json"  # where the dgpp_engine role keeps the head's
TIMEOUT_S = 3.0
MIN_LINK_SHARE = 0.5  # all-reduce bus bandwidth below this share of the link's rate warns
FALLBACK_FIX = (
    "a Triton kernel fell back to its PyTorch twin: correct tokens, slower; report the reason "
    "(with `dgpp support-bundle`)"
)
ALLREDUCE_FIX = (
    "check the link: `dgpp doctor --interface <cluster interface>` (the rdma checks: both RoCE "
    "twins in NCCL_IB_HCA, the RoCE v2 GID index, the MTU)"
)


def default_url(probe: Probe) -> str:
    """The head on this node: the port of the deployment it runs, else the default port."""
    port = DEFAULT_PORT
    text = probe.read(DEPLOYMENT_FILE).text
    try:
        value = json.loads(text)["http"]["port"] if text else None
        if isinstance(value, int) and 0 < value < 65536:
            port = value
    except (ValueError, KeyError, TypeError):
        pass
    return f"http://127.0.0.1:{port}"


def fetch_metrics(url: str, api_key: str | None, timeout_s: float = TIMEOUT_S) -> tuple[Any, str]:
    """The body of `GET <url>/v1/metrics`, or None and why not."""
    request = urllib.request.Request(url.rstrip("/") + "/v1/metrics")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            body = response.read()
    except urllib.error.HTTPError as err:
        hint = " (give --api-key or DGPP_API_KEY)" if err.code in (401, 403) else ""
        return None, f"the engine at {url} answered HTTP {err.code}{hint}"
    except (urllib.error.URLError, OSError, ValueError):
        return None, f"no engine answering at {url}"
    try:
        return json.loads(body), ""
    except ValueError:
        return None, f"the engine at {url} answered /v1/metrics with no JSON"


def engine_checks(
    url: str, api_key: str | None, link_gbps: float | None = None, timeout_s: float = TIMEOUT_S
) -> list[Check]:
    """`link_gbps`: the cluster link's rate in Gbit/s, when known."""
    metrics, why = fetch_metrics(url, api_key, timeout_s)
    if metrics is None:
        return [Check("engine", "unknown", why)]
    if not isinstance(metrics, dict):
        return [Check("engine", "unknown", f"{url}/v1/metrics is not a JSON object")]
    checks = _kernels(metrics.get("kernels"))
    if "allreduce" in metrics:
        checks.append(_allreduce(metrics["allreduce"], link_gbps))
    return checks


def _kernels(kernels: object) -> list[Check]:
    if kernels is None:
        return [Check("engine.kernels", "unknown", "the engine reports no kernel self-check")]
    if not isinstance(kernels, dict):
        return [Check("engine.kernels", "unknown", "the engine's `kernels` is not an object")]
    fallbacks = [
        Check(f"engine.kernel.{name}", "warn", f"{name}: {state}", FALLBACK_FIX)
        for name, state in sorted(kernels.items())
        if isinstance(state, str) and state.startswith("fallback")
    ]
    odd = sorted(n for n, s in kernels.items() if s != "ok" and not str(s).startswith("fallback"))
    if odd:
        detail = f"unexpected self-check states for {', '.join(map(str, odd))}"
        fallbacks.append(Check("engine.kernels", "unknown", detail))
    if not fallbacks:
        return [Check("engine.kernels", "pass", f"{len(kernels)} Triton kernels passed")]
    return fallbacks


def _allreduce(entries: object, link_gbps: float | None) -> Check:
    name = "engine.allreduce"
    rates = []
    for entry in entries if isinstance(entries, list) else []:
        value = entry.get("bus_gbps") if isinstance(entry, dict) else None
        if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0:
            rates.append((entry.get("bytes"), float(value)))
    if not rates:
        return Check(name, "unknown", "the engine's `allreduce` holds no bus_gbps")
    size, best = max(rates, key=lambda rate: rate[1])
    measured = f"best all-reduce bus bandwidth {best:.1f} Gb/s (at {size} bytes)"
    if not link_gbps:
        return Check(name, "pass", f"{measured}; the link's rate is unknown")
    share = best / link_gbps
    detail = f"{measured}: {share:.0%} of the link's {link_gbps:g} Gb/s"
    if share < MIN_LINK_SHARE:
        return Check(name, "warn", detail, ALLREDUCE_FIX)
    return Check(name, "pass", detail)


def link_gbps(probe: Probe, interface: str | None) -> float | None:
    """The interface's rate from /sys/class/net/<interface>/speed (Mb/s); None when unknown."""
    if not interface:
        return None
    text = (probe.read(f"/sys/class/net/{interface}/speed").text or "").strip()
    return int(text) / 1000 if text.isdigit() and int(text) > 0 else None
