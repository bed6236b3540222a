"""Every template and static file of the console ships in the wheel (pyproject's package-data),
and nothing under static/ is fetched from elsewhere at run time."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WEBUI = ROOT / "webui"


def test_package_data_covers_every_template_and_static_file() -> None:
    settings = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = settings["package-data"]["dgpp.webui"]
    shipped = {path for pattern in patterns for path in WEBUI.glob(pattern) if path.is_file()}
    needed = {
        path
        for folder in ("templates", "static")
        for path in (WEBUI / folder).rglob("*")
        if path.is_file()
    }
    assert needed - shipped == set()
    subpackages = {f"dgpp.webui.{init.parent.name}" for init in WEBUI.glob("*/__init__.py")}
    assert "dgpp.webui.routes" in subpackages
    assert subpackages - set(settings["packages"]) == set()


def test_uplot_is_vendored_with_its_licence() -> None:
    vendor = WEBUI / "static" / "vendor" / "uplot"
    assert (vendor / "uPlot.iife.min.js").stat().st_size > 10_000
    assert "MIT License" in (vendor / "LICENSE").read_text()


def test_pages_and_scripts_reach_no_other_host() -> None:
    own = [*WEBUI.glob("templates/*.html"), *WEBUI.glob("static/*.js"), *WEBUI.glob("static/*.css")]
    for path in own:
        assert not re.search(r"(src|href)=\"(https?:)?//", path.read_text()), path
        assert "http://" not in path.read_text() and "https://" not in path.read_text(), path
