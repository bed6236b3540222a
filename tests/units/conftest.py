"""The `nspawn` marker: tests that boot a real systemd in a container (root, debootstrap,
systemd-nspawn; minutes). They run only with DGPP_NSPAWN=1."""

from __future__ import annotations

import os

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "nspawn: boots systemd in a Debian container; runs only with DGPP_NSPAWN=1"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("DGPP_NSPAWN") == "1":
        return
    skip = pytest.mark.skip(reason="boots a systemd container; set DGPP_NSPAWN=1 to run it")
    for item in items:
        if "nspawn" in item.keywords:
            item.add_marker(skip)
