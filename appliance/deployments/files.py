"""From files to one effective deployment: a shipped template, the site's deployment file, the
cluster inventory and command-line overrides, merged in that order and validated once.

A site file names its template (`"template": "qwen3-8b_bfloat16_w2"`) and overrides what it must;
the inventory supplies where the ranks meet (the head's address, the rendezvous port) and the world
size; `--set engine.kv_capacity=8192` wins over everything. The result has an id: a short hash of
its canonical JSON, which names its log folder.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dgpp.appliance.common.json_file import read_object
from dgpp.appliance.deployments.deployment import Deployment, parse_deployment
from dgpp.engine.errors import ConfigError

TEMPLATES_DIR = Path(__file__).parents[1] / "templates"


@dataclass(frozen=True)
class Template:
    name: str  # <model>_<dtype>_w<N>
    path: Path

    def load(self) -> dict[str, Any]:
        return _read_json(self.path)


def list_templates() -> list[Template]:
    return [Template(path.stem, path) for path in sorted(TEMPLATES_DIR.glob("*.json"))]


def find_template(name: str) -> Template:
    for template in list_templates():
        if template.name == name:
            return template
    names = ", ".join(t.name for t in list_templates())
    raise ConfigError(f"template: no template named {name!r}; shipped templates: {names}")


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """`override` over `base`, section by section (objects merge, everything else replaces)."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def expand_template(raw: dict[str, Any]) -> dict[str, Any]:
    """The site file with its template (if it names one) filled in beneath it."""
    name = raw.get("template")
    if name is None:
        return raw
    if not isinstance(name, str):
        raise ConfigError(f"template: must be a template name, got {name!r}")
    site = {key: value for key, value in raw.items() if key != "template"}
    return merge(find_template(name).load(), site)


def parse_override(text: str) -> tuple[list[str], Any]:
    """`engine.kv_capacity=8192` -> (["engine", "kv_capacity"], 8192); values are JSON when they
    parse as JSON (numbers, true/false/null, lists, objects), strings otherwise."""
    path, sep, value = text.partition("=")
    if not sep or not path.strip():
        raise ConfigError(f"--set {text!r}: expected KEY.PATH=VALUE")
    try:
        parsed: Any = json.loads(value)
    except json.JSONDecodeError:
        parsed = value
    return path.strip().split("."), parsed


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for text in overrides:
        keys, value = parse_override(text)
        patch: dict[str, Any] = {keys[-1]: value}
        for key in reversed(keys[:-1]):
            patch = {key: patch}
        raw = merge(raw, patch)
    return raw


def inventory_settings(inventory: Path) -> dict[str, Any]:
    """What an Ansible inventory (YAML, groups `head` and `workers`) says about the deployment:
    the world size, the head's address, the rendezvous / HTTP ports and the HTTP key files when
    set as variables."""
    import yaml

    try:
        data = yaml.safe_load(inventory.read_text()) or {}
    except OSError as err:
        raise ConfigError(f"cannot read the inventory {inventory}: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{inventory} is not valid YAML: {err}") from None
    groups = _groups(data)
    head_hosts = groups.get("head", {})
    if len(head_hosts) != 1:
        raise ConfigError(f"{inventory}: group 'head' must hold exactly one host")
    ((head_name, head_vars),) = head_hosts.items()
    common = _group_vars(data)
    head_vars = {**common, **head_vars}
    ranks = [head_vars.get("dgpp_rank", 0)]
    ranks += [
        {**common, **host_vars}.get("dgpp_rank") for host_vars in groups.get("workers", {}).values()
    ]
    world_size = len(ranks)
    if sorted(r for r in ranks if isinstance(r, int)) != list(range(world_size)):
        raise ConfigError(
            f"{inventory}: dgpp_rank must number the hosts 0..{world_size - 1} (head is 0), "
            f"got {ranks}"
        )
    settings: dict[str, Any] = {
        "world_size": world_size,
        "rendezvous": {
            "head": str(
                head_vars.get("dgpp_head_address", head_vars.get("ansible_host", head_name))
            )
        },
    }
    if "dgpp_rendezvous_port" in head_vars:
        settings["rendezvous"]["port"] = int(head_vars["dgpp_rendezvous_port"])
    http: dict[str, Any] = {}
    if "dgpp_http_port" in head_vars:
        http["port"] = int(head_vars["dgpp_http_port"])
    # A key the inventory gives (a value or a vault reference) goes into a file the deployment
    # names, as the dgpp_engine role writes it.
    for kind in ("api", "admin"):
        if str(head_vars.get(f"dgpp_engine_{kind}_key") or ""):
            default = f"/etc/dgpp/{kind}-key"
            http[f"{kind}_key_file"] = str(head_vars.get(f"dgpp_engine_{kind}_key_file", default))
    if http:
        settings["http"] = http
    return settings


def _groups(data: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """group name -> host name -> host variables, from `all.children` or top-level groups."""
    root = data.get("all", data)
    children = root.get("children", {}) if isinstance(root, dict) else {}
    found: dict[str, dict[str, dict[str, Any]]] = {}
    for name in ("head", "workers"):
        group = children.get(name) or data.get(name) or {}
        hosts = group.get("hosts") or {}
        found[name] = {host: dict(values or {}) for host, values in hosts.items()}
    return found


def _group_vars(data: dict[str, Any]) -> dict[str, Any]:
    root = data.get("all", {})
    return dict(root.get("vars") or {}) if isinstance(root, dict) else {}


def resolve(
    path: Path | None,
    inventory: Path | None = None,
    overrides: list[str] | None = None,
) -> Deployment:
    """Template + site file + inventory + overrides, validated as one deployment."""
    raw: dict[str, Any] = expand_template(_read_json(path)) if path is not None else {}
    if inventory is not None:
        settings = inventory_settings(inventory)
        declared = raw.get("world_size")
        if declared is not None and declared != settings["world_size"]:
            raise ConfigError(
                f"world_size: the deployment says {declared}, the inventory {inventory} has "
                f"{settings['world_size']} hosts"
            )
        raw = merge(raw, settings)
    raw = apply_overrides(raw, overrides or [])
    return parse_deployment(raw, str(path) if path is not None else "the deployment")


def deployment_json(deployment: Deployment) -> str:
    """The effective deployment, every key spelled out, in a stable order."""
    return json.dumps(deployment.model_dump(mode="json"), indent=2, sort_keys=True) + "\n"


def deployment_id(deployment: Deployment) -> str:
    """A short, stable name for an effective deployment (its log folder's name)."""
    canonical = json.dumps(deployment.model_dump(mode="json"), sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()[:12]


def _read_json(path: Path) -> dict[str, Any]:
    return read_object(path, "the deployment")
