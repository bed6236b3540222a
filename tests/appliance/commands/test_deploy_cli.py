"""Templates, `dgpp deploy validate|resolve|templates`, deployment ids, log folders and the
support bundle."""

from __future__ import annotations

import contextlib
import io
import json
import tarfile
from pathlib import Path

import pytest

from dgpp.appliance import cli
from dgpp.appliance.common.exit_codes import EXIT_CONFIG, EXIT_OK
from dgpp.appliance.deployments.files import (
    deployment_id,
    list_templates,
    resolve,
)
from dgpp.appliance.deployments.log import attach_rank_log, record_deployment
from dgpp.appliance.models.facts import facts_config
from dgpp.engine.errors import ConfigError
from dgpp.engine.layers.head_partition import partition_heads

# The default model's head counts, to check each world splits (the other templates' models
# have shipped facts: appliance/checkpoint_facts).
DEFAULT_HEADS = (9, 3)

INVENTORY = """
all:
  vars:
    dgpp_rendezvous_port: 29600
  children:
    head:
      hosts:
        spark1: {ansible_host: 10.0.0.1, dgpp_rank: 0, dgpp_http_port: 8000}
    workers:
      hosts:
        spark2: {ansible_host: 10.0.0.2, dgpp_rank: 1}
"""


def _run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(argv))
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("template", list_templates(), ids=lambda t: t.name)
def test_every_template_is_valid_and_named_for_what_it_holds(template: object) -> None:
    name = template.name  # type: ignore[attr-defined]
    _model, dtype, world = name.rsplit("_", 2)
    deployment = resolve(template.path)  # type: ignore[attr-defined]
    assert deployment.engine.dtype == dtype
    assert f"w{deployment.world_size}" == world
    if deployment.model == "default":
        num_heads, num_kv = DEFAULT_HEADS
    else:
        facts = facts_config(deployment.model)
        num_heads, num_kv = facts.num_heads, facts.num_kv_heads
    for rank in range(deployment.world_size):
        partition_heads(num_heads, num_kv, deployment.world_size, rank)


def test_the_default_model_has_a_world_one_template() -> None:
    names = {t.name for t in list_templates()}
    assert "smollm2-135m_float32_w1" in names


def test_resolve_merges_template_site_inventory_and_overrides(tmp_path: Path) -> None:
    site = tmp_path / "site.json"
    site.write_text(
        json.dumps(
            {
                "template": "qwen3-8b_bfloat16_w2",
                "model": "/srv/dgpp/models/Qwen3-8B",
                "engine": {"kv_capacity": 65536},
            }
        )
    )
    inventory = tmp_path / "inventory.yml"
    inventory.write_text(INVENTORY)
    code, out, err = _run(
        "deploy", "resolve", str(site), "--inventory", str(inventory), "--set", "engine.seed=7"
    )
    assert code == EXIT_OK, err
    resolved = json.loads(out)
    assert resolved["model"] == "/srv/dgpp/models/Qwen3-8B"
    assert resolved["engine"]["kv_capacity"] == 65536  # the site's value
    assert resolved["engine"]["max_model_len"] == 32768  # the template's
    assert resolved["engine"]["seed"] == 7  # --set
    assert resolved["rendezvous"] == {"backend": "nccl", "head": "10.0.0.1", "port": 29600}
    assert resolved["http"]["port"] == 8000
    assert (
        err.strip() == f"deployment id {deployment_id(resolve(site, inventory, ['engine.seed=7']))}"
    )


def test_the_inventory_must_agree_with_the_world_size(tmp_path: Path) -> None:
    site = tmp_path / "site.json"
    site.write_text(json.dumps({"template": "qwen3-8b_bfloat16_w4"}))
    inventory = tmp_path / "inventory.yml"
    inventory.write_text(INVENTORY)
    code, _, err = _run("deploy", "resolve", str(site), "--inventory", str(inventory))
    assert code == EXIT_CONFIG
    assert "world_size: the deployment says 4, the inventory" in err


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"template": "nope_float32_w1"}, "template: no template named 'nope_float32_w1'"),
        ({"template": "smollm2-135m_float32_w1", "engine": {"kv": 1}}, "engine.kv: unknown key"),
        (
            {"template": "smollm2-135m_float32_w1", "engine": {"dtype": "fp8"}},
            "engine.dtype: must be one of",
        ),
    ],
)
def test_validate_names_the_bad_key(tmp_path: Path, raw: dict[str, object], message: str) -> None:
    site = tmp_path / "site.json"
    site.write_text(json.dumps(raw))
    code, _, err = _run("deploy", "validate", str(site))
    assert code == EXIT_CONFIG
    assert message in err


def test_validate_prints_a_stable_id(tmp_path: Path) -> None:
    site = tmp_path / "site.json"
    site.write_text(json.dumps({"template": "smollm2-135m_float32_w1"}))
    first = _run("deploy", "validate", str(site))
    reordered = tmp_path / "again.json"
    reordered.write_text(json.dumps({"template": "smollm2-135m_float32_w1", "world_size": 1}))
    second = _run("deploy", "validate", str(reordered))
    assert first[0] == second[0] == EXIT_OK
    assert first[1].split()[-1] == second[1].split()[-1]


def test_override_syntax_errors_are_clear() -> None:
    with pytest.raises(ConfigError, match=r"expected KEY\.PATH=VALUE"):
        resolve(None, None, ["engine.kv_capacity"])


def test_support_bundle_packs_the_folder_without_secrets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import logging

    monkeypatch.setenv("DGPP_LOG_DIR", str(tmp_path / "logs"))
    secret = "sk-live-0123456789abcdef"
    key_file = tmp_path / "api.key"
    key_file.write_text(secret + "\n")
    site = tmp_path / "site.json"
    site.write_text(json.dumps({"model": "default", "http": {"api_key_file": str(key_file)}}))
    ident, folder = record_deployment(resolve(site))
    assert folder is not None and (folder / "deployment.json").is_file()
    handler = attach_rank_log(ident, 0)
    assert handler is not None and handler.baseFilename == str(folder / "rank0.log")
    logger = logging.getLogger("dgpp.test.bundle")
    logger.warning("client sent Authorization: Bearer %s and api_key=%s", secret, "hunter2xyz")
    logging.getLogger().removeHandler(handler)
    handler.close()
    out = tmp_path / "bundle.tar.gz"
    code, printed, err = _run("support-bundle", "--id", ident, "--output", str(out))
    assert code == EXIT_OK, err
    assert printed.strip() == str(out)
    assert out.stat().st_mode & 0o777 == 0o600
    with tarfile.open(out) as tar:
        names = sorted(m.name.split("/", 1)[1] for m in tar.getmembers())
        texts = {m.name: tar.extractfile(m).read().decode() for m in tar.getmembers()}  # type: ignore[union-attr]
    assert names == ["deployment.json", "host.txt", "rank0.log"]
    everything = "\n".join(texts.values())
    assert secret not in everything and "hunter2xyz" not in everything
    assert "<redacted>" in everything
    assert str(key_file) in everything  # the key file's path is kept; its content never is
    assert "torch:" in everything


def test_support_bundle_without_logs_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DGPP_LOG_DIR", str(tmp_path / "empty"))
    code, _, err = _run("support-bundle")
    assert code == EXIT_CONFIG
    assert "no deployment has logged" in err
