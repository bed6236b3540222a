"""HTTP keys are read by one reader on every launch path, an empty key refuses to start, and a
deployment that lets other machines reach the API without a key is refused (real processes and
real HTTP where a launch path is under test)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from dgpp.appliance.common.exit_codes import EXIT_CONFIG, EXIT_OK
from dgpp.appliance.deployments.deployment import is_loopback, parse_deployment, server_config
from dgpp.appliance.deployments.http_keys import read_key_file
from dgpp.engine.errors import ConfigError
from dgpp.webui.deployments.store import engine_target
from tests.appliance.commands.test_rank_cli import _dgpp
from tests.appliance.world_harness import start, wait_healthy
from tests.conftest import build_tiny_checkpoint
from tests.engine.server.harness import free_port


def _key(tmp_path: Path, text: str, name: str = "api-key") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_key_file_is_stripped_and_an_empty_one_refused(tmp_path: Path) -> None:
    assert read_key_file(str(_key(tmp_path, "  s3cret\n")), "http.api_key_file") == "s3cret"
    for text in ("", " \n\t "):
        with pytest.raises(ConfigError, match="is empty: an empty key would let every request"):
            read_key_file(str(_key(tmp_path, text)), "http.api_key_file")
    with pytest.raises(ConfigError, match=r"cannot read http\.api_key_file"):
        read_key_file(str(tmp_path / "missing"), "http.api_key_file")


def test_server_config_reads_both_key_files(tmp_path: Path) -> None:
    deployment = parse_deployment(
        {
            "model": "default",
            "http": {
                "api_key_file": str(_key(tmp_path, "api\n")),
                "admin_key_file": str(_key(tmp_path, "adm\n", "admin-key")),
                "metrics_require_key": True,
            },
        }
    )
    server = server_config(deployment)
    assert (server.api_key, server.admin_key, server.metrics_require_key) == ("api", "adm", True)
    assert server_config(deployment, "flag").api_key == "flag"  # --api-key wins
    with pytest.raises(ConfigError, match="--api-key is empty"):
        server_config(deployment, "  ")


@pytest.mark.parametrize("command", [["serve"], ["rank", "--rank", "0"]])
def test_every_launch_path_refuses_an_empty_key_file(tmp_path: Path, command: list[str]) -> None:
    deployment = tmp_path / "d.json"
    empty = _key(tmp_path, "\n")
    deployment.write_text(json.dumps({"model": "default", "http": {"api_key_file": str(empty)}}))
    result = _dgpp(*command, "--deployment", str(deployment))
    assert result.returncode == EXIT_CONFIG, result.stderr
    assert f"http.api_key_file {empty} is empty" in result.stderr


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.10", "spark-0.lan"])
def test_a_reachable_host_needs_a_key_or_an_explicit_choice(tmp_path: Path, host: str) -> None:
    site = tmp_path / "site.json"
    site.write_text(json.dumps({"model": "default", "http": {"host": host}}))
    result = _dgpp("deploy", "validate", str(site))
    assert result.returncode == EXIT_CONFIG
    assert f"http: Value error, host {host!r} lets other machines reach the API" in result.stderr
    for allowed in ({"api_key_file": "/etc/dgpp/api-key"}, {"allow_unauthenticated": True}):
        site.write_text(json.dumps({"model": "default", "http": {"host": host, **allowed}}))
        assert _dgpp("deploy", "validate", str(site)).returncode == EXIT_OK
    served = _dgpp("serve", "--host", host, "--port", str(free_port()))
    assert served.returncode == EXIT_CONFIG, served.stderr  # before binding or loading anything
    assert "lets other machines reach the API" in served.stderr


def test_loopback_hosts() -> None:
    assert all(map(is_loopback, ["127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "", "::", "10.0.0.1", "spark-0"]))


def test_serve_with_a_deployment_enforces_its_key_file(tmp_path: Path, tokenizer_dir: Path) -> None:
    """`dgpp serve --deployment F` used to ignore http.api_key_file and serve without a key."""
    checkpoint = build_tiny_checkpoint(tmp_path / "tiny", tokenizer_dir, "LlamaForCausalLM")
    port = free_port()
    deployment = tmp_path / "d.json"
    http = {"port": port, "api_key_file": str(_key(tmp_path, "k-123\n"))}
    deployment.write_text(json.dumps({"model": str(checkpoint), "http": http}))
    process = start(["serve", "--deployment", str(deployment)], tmp_path / "serve.log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process)
        assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 401
        authorized = {"Authorization": "Bearer k-123"}
        assert httpx.get(f"{url}/v1/models", headers=authorized, timeout=10).status_code == 200
    finally:
        assert process.stop() == 0, process.text()[-3000:]
    assert "k-123" not in process.text()


def test_the_console_sends_the_admin_key_to_admin_routes_only(tmp_path: Path) -> None:
    deployment = parse_deployment(
        {
            "model": "m",
            "http": {
                "api_key_file": str(_key(tmp_path, "api")),
                "admin_key_file": str(_key(tmp_path, "adm", "admin-key")),
            },
        }
    )
    target = engine_target(deployment)
    assert target.headers("/admin/drain") == {"Authorization": "Bearer adm"}
    assert target.headers("/v1/metrics") == {"Authorization": "Bearer api"}
    assert "api" not in repr(target).replace("api_key", "")
    unkeyed = engine_target(parse_deployment({"model": "m"}))
    assert unkeyed.headers("/admin/drain") == {} == unkeyed.headers("/health")


@pytest.mark.parametrize("name", ["two-node", "four-node"])
def test_the_shipped_inventories_bind_one_address_behind_a_key(tmp_path: Path, name: str) -> None:
    """What the playbook gives the head for the example inventories is a valid deployment: the
    API on the head's client-facing address, the key files named."""
    import yaml

    from dgpp.appliance.deployments.files import resolve

    inventory = Path(__file__).resolve().parents[3] / "playbooks/inventories" / f"{name}.yml"
    site = tmp_path / "site.json"
    site.write_text(
        json.dumps(yaml.safe_load(inventory.read_text())["all"]["vars"]["dgpp_engine_deployment"])
    )
    deployment = resolve(site, inventory)
    assert deployment.http.host == "192.0.2.10" and not deployment.http.allow_unauthenticated
    assert deployment.http.api_key_file == "/etc/dgpp/api-key"
    assert deployment.http.admin_key_file == "/etc/dgpp/admin-key"
    without_keys = tmp_path / "no-keys.yml"
    text = inventory.read_text()
    without_keys.write_text(
        "\n".join(line for line in text.splitlines() if "_key: " not in line) + "\n"
    )
    with pytest.raises(ConfigError, match="lets other machines reach the API"):
        resolve(site, without_keys)
