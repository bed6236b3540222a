"""Whether the console's `engine_url` names the engine its backend runs.

With the local backend the console starts rank 0 from the deployment file, and rank 0 listens on
the deployment's `http.host` and `http.port`. An `engine_url` naming any other address makes the
console watch one engine while it starts, restarts and switches another: the overview would mix
the two. So a console that autostarts refuses such a URL, and one that does not warns."""

from __future__ import annotations

import functools
import ipaddress
import socket
from urllib.parse import urlsplit

import psutil

from dgpp.appliance.common.json_file import read_object
from dgpp.appliance.control.backend import BackendKind
from dgpp.appliance.deployments.deployment import Deployment
from dgpp.engine.errors import ConfigError
from dgpp.webui.core.config import ConsoleConfig
from dgpp.webui.deployments.store import engine_target, resolve_raw

_ANY_ADDRESS = frozenset({"", "0.0.0.0", "::"})
_LOOPBACK = "loopback"  # every loopback address is this machine


def foreign_engine_url(engine_url: str | None, deployment: Deployment) -> str | None:
    """`engine_url` when it does not reach the deployment's own HTTP address; else None."""
    if engine_url is None:
        return None
    try:
        target = urlsplit(engine_url if "//" in engine_url else f"//{engine_url}")
        port = target.port or (443 if target.scheme == "https" else 80)
    except ValueError:
        return engine_url  # not a URL this console could be talking to its engine through
    http = deployment.http
    if port != http.port or not _addresses(target.hostname or "") & _addresses(http.host):
        return engine_url
    return None


def check_engine_url(config: ConsoleConfig, backend: BackendKind) -> None:
    """At start: refuse a local backend that autostarts one engine while `engine_url` names
    another (a deployment that does not resolve cannot be compared, and is shown instead)."""
    if backend != "local" or not config.autostart or config.engine_url is None:
        return
    try:
        deployment = resolve_raw(read_object(config.deployment, "the deployment"))
    except ConfigError:
        return
    url = foreign_engine_url(config.engine_url, deployment)
    if url is not None:
        own = engine_target(deployment).url
        raise ConfigError(
            f"--engine-url (engine_url) names {url}, but the local backend starts the engine of "
            f"{config.deployment} on {own}: the console would watch one engine and run another. "
            "Drop --engine-url, pass --no-autostart (autostart: false) to watch that engine "
            "without starting one, or use the systemd backend for an engine systemd runs"
        )


def foreign_engine_warning(
    config: ConsoleConfig, backend: BackendKind, deployment: Deployment
) -> str | None:
    """The overview's warning for a local backend whose `engine_url` names another engine."""
    if backend != "local" or (url := foreign_engine_url(config.engine_url, deployment)) is None:
        return None
    own = engine_target(deployment).url
    return (
        f"The console shows the engine at {url} (engine_url), which this console does not run: "
        f"the local backend's rank 0 listens on {own}, and restarts and switches act on that one."
    )


@functools.lru_cache(maxsize=64)
def _addresses(host: str) -> frozenset[str]:
    """The addresses `host` stands for: every one of this machine's for a bind-all host, the
    resolved ones for a name (itself when it does not resolve); loopback ones as one."""
    host = host.strip("[]").lower()
    if host in _ANY_ADDRESS:
        return _this_machine()
    try:
        found = {ipaddress.ip_address(host)}
    except ValueError:
        try:
            found = {
                ipaddress.ip_address(str(info[4][0])) for info in socket.getaddrinfo(host, None)
            }
        except (OSError, ValueError):
            return frozenset({host})
    if any(address.is_unspecified for address in found):
        return _this_machine()
    return frozenset(_LOOPBACK if address.is_loopback else str(address) for address in found)


def _this_machine() -> frozenset[str]:
    addresses = {_LOOPBACK}
    for entries in psutil.net_if_addrs().values():
        for entry in entries:
            if entry.family in (socket.AF_INET, socket.AF_INET6):
                text = entry.address.split("%")[0]  # fe80::1%eth0: the zone is no address
                try:
                    address = ipaddress.ip_address(text)
                except ValueError:
                    continue
                addresses.add(_LOOPBACK if address.is_loopback else str(address))
    return frozenset(addresses)
