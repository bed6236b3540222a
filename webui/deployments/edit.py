"""New deployments from the current one: another model (an installed checkpoint, a reference, or
a shipped template) and the key-by-key difference an operator confirms before applying.

The console edits the deployment file as written (a site file may name a template and override
a few keys); what it compares is the effective deployment rank 0 will run
(`dgpp.appliance.deployments.diff`)."""

from __future__ import annotations

from typing import Any

from dgpp.appliance.deployments.files import merge

# What belongs to the site, not to the model: kept when a template replaces the deployment.
SITE_KEYS = ("world_size", "rendezvous", "timeouts", "resident_cache", "paths")
SITE_HTTP_KEYS = ("host", "port", "api_key_file", "max_body_bytes", "stats_log_interval_s")


def with_model(raw: dict[str, Any], model: str, served_name: str | None) -> dict[str, Any]:
    """The file with another model. The served names belonged to the old model: they become
    `served_name` (or the new model's default name when None)."""
    names = [served_name] if served_name else []
    return merge(raw, {"model": model, "http": {"served_model_names": names}})


def with_template(raw: dict[str, Any], template: str) -> dict[str, Any]:
    """A file naming `template`, with this site's own keys (ports, world, timeouts) kept."""
    site: dict[str, Any] = {"template": template}
    for key in SITE_KEYS:
        if key in raw:
            site[key] = raw[key]
    http = {key: value for key, value in raw.get("http", {}).items() if key in SITE_HTTP_KEYS}
    if http:
        site["http"] = http
    return site
