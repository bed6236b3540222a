"""playbooks/ parses with every example inventory and passes ansible-lint's production profile."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.playbooks.staging import BIN, PLAYBOOKS, ansible_env

pytestmark = pytest.mark.skipif(
    shutil.which("ansible-playbook", path=str(BIN)) is None,
    reason="ansible is not installed (pip install -e '.[test]')",
)


@pytest.mark.parametrize("inventory", ["single", "two-node", "four-node"])
def test_cluster_playbook_parses_with_the_example_inventory(inventory: str, tmp_path: Path):
    completed = subprocess.run(
        [BIN / "ansible-playbook", "--syntax-check", "-i", f"inventories/{inventory}.yml"]
        + ["cluster.yml"],
        cwd=PLAYBOOKS,
        env=ansible_env(tmp_path),
        capture_output=True,
        text=True,
        check=False,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr


def test_ansible_lint_production_profile_passes(tmp_path: Path):
    if shutil.which("ansible-lint", path=str(BIN)) is None:
        pytest.skip("ansible-lint is not installed (pip install -e '.[test]')")
    completed = subprocess.run(
        [
            BIN / "ansible-lint",
            "--offline",
            "--nocolor",
        ],  # profile and paths: playbooks/.ansible-lint
        cwd=PLAYBOOKS,
        env=ansible_env(tmp_path),
        capture_output=True,
        text=True,
        check=False,
    )
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output
    assert "Profile 'production' was required, and it passed" in output


def test_every_role_variable_is_prefixed_and_documented():
    import yaml

    for role in sorted((PLAYBOOKS / "roles").iterdir()):
        defaults = yaml.safe_load((role / "defaults/main.yml").read_text()) or {}
        specs = yaml.safe_load((role / "meta/argument_specs.yml").read_text())
        options = specs["argument_specs"]["main"]["options"]
        assert set(defaults) <= set(options), (role.name, set(defaults) - set(options))
        assert all(name.startswith(f"{role.name}_") for name in defaults), role.name
        for name, option in options.items():
            assert option.get("description"), (role.name, name)
        tasks = yaml.safe_load((role / "tasks/main.yml").read_text())
        for task in tasks:  # a table of contents: phase files, tagged with the role and phase
            assert set(task) <= {"name", "ansible.builtin.import_tasks", "tags", "when"}, task
            phase = task["ansible.builtin.import_tasks"].removesuffix(".yml")
            assert role.name in task["tags"], task
            assert {"preflight", "install", "configure", "service"} & set(task["tags"]), task
            assert phase in task["tags"] or phase in ("python", "export", "mount"), task
