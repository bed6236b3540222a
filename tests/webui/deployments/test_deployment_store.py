"""The deployment file: atomic replacement with earlier versions kept, the engine's address, the
template switch keeping the site's keys, and the diff."""

from __future__ import annotations

import json
import stat
from pathlib import Path

from dgpp.appliance.deployments.deployment import parse_deployment
from dgpp.appliance.deployments.diff import diff
from dgpp.webui.deployments.edit import with_model, with_template
from dgpp.webui.deployments.store import DeploymentStore, engine_target, resolve_raw


def test_writes_replace_the_file_and_keep_earlier_versions(tmp_path: Path) -> None:
    path = tmp_path / "deployment.json"
    path.write_text(json.dumps({"model": "a"}))
    path.chmod(0o640)
    store = DeploymentStore(path, tmp_path / "backups", keep=2)
    for model in ("b", "c", "d"):
        store.write({"model": model})
    assert store.read_raw() == {"model": "d"}
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    backups = sorted((tmp_path / "backups").glob("deployment-*.json"))
    assert [json.loads(p.read_text())["model"] for p in backups] == ["b", "c"]
    assert not list(tmp_path.glob(".deployment.json.*"))


def test_kept_files_are_listed_newest_first_and_read_by_name_only(tmp_path: Path) -> None:
    path = tmp_path / "deployment.json"
    path.write_text(json.dumps({"model": "a"}))
    store = DeploymentStore(path, tmp_path / "backups")
    assert store.kept() == []
    store.write({"model": "b"})
    store.write({"model": "c"})
    kept = store.kept()
    assert [json.loads(store.read_kept(k.name) or "")["model"] for k in kept] == ["b", "a"]
    assert all(abs(k.replaced_at - path.stat().st_mtime) < 60 for k in kept)
    (tmp_path / "secret.json").write_text("{}")
    for name in ("../secret", "deployment-x", f"{kept[0].name}.json", "deployment.json"):
        assert store.read_kept(name) is None
    assert store.read_kept("deployment-20000101-000000-000000000") is None  # pruned or never


def test_a_rewrite_keeps_the_group_the_ranks_read_it_through(tmp_path: Path) -> None:
    """The console runs as its own user; the ranks read the file through its group (dgpp)."""
    import os

    import pytest

    path = tmp_path / "deployment.json"
    path.write_text(json.dumps({"model": "a"}))
    other_gid = next((g for g in (65534, 100, 1) if g != os.getegid()), None)
    try:
        os.chown(path, -1, other_gid)
    except (OSError, TypeError):
        pytest.skip("cannot give the file another group here (needs root or group membership)")
    path.chmod(0o640)
    DeploymentStore(path, tmp_path / "backups").write({"model": "b"})
    assert (path.stat().st_gid, stat.S_IMODE(path.stat().st_mode)) == (other_gid, 0o640)


def test_the_engine_target_follows_the_deployment(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("sk-secret\n")
    deployment = parse_deployment(
        {"model": "m", "http": {"host": "0.0.0.0", "port": 9000, "api_key_file": str(key)}}
    )
    target = engine_target(deployment)
    assert (target.url, target.api_key) == ("http://127.0.0.1:9000", "sk-secret")
    assert "sk-secret" not in repr(target)
    assert engine_target(deployment, "http://head:1/").url == "http://head:1"


def test_a_template_replaces_the_model_and_keeps_the_site() -> None:
    raw = {
        "model": "/models/x",
        "world_size": 1,
        "engine": {"kv_capacity": 99},
        "http": {"port": 9000, "served_model_names": ["x"], "api_key_file": "/etc/dgpp/key"},
        "timeouts": {"load_s": 60},
        "speculative": {"method": "ngram"},  # the model's, like the engine knobs
    }
    new = with_template(raw, "smollm2-135m_float32_w1")
    assert new == {
        "template": "smollm2-135m_float32_w1",
        "world_size": 1,
        "timeouts": {"load_s": 60},
        "http": {"port": 9000, "api_key_file": "/etc/dgpp/key"},
    }
    resolved = resolve_raw(new)
    assert resolved.http.port == 9000 and resolved.timeouts.load_s == 60


def test_a_model_switch_resets_the_served_names_and_diff_lists_what_changed() -> None:
    raw = {"model": "/models/a", "http": {"served_model_names": ["a"], "port": 9000}}
    new_raw = with_model(raw, "/models/b", None)
    assert new_raw["http"] == {"served_model_names": [], "port": 9000}
    changes = diff(resolve_raw(raw), resolve_raw(new_raw))
    assert [(c.path, c.old_text, c.new_text) for c in changes] == [
        ("http.served_model_names", '["a"]', "[]"),
        ("model", '"/models/a"', '"/models/b"'),
    ]
