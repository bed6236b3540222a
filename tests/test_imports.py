"""Imports run one way, kernels at the bottom: kernels <- engine <- appliance <- webui; inside
the engine, its server, the appliance and the console, along their layer tables (`LAYERS`,
docs/engine.md's map), each package importing only those below it; and no two dgpp modules
import each other, directly or around a loop, at any depth of a function (a late import hides a
cycle, it does not remove it). Imports under `if TYPE_CHECKING:` are annotations only and do not
count."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"engine": "dgpp.engine", "kernels": "dgpp.kernels", "appliance": "dgpp.appliance"}
PACKAGES["webui"] = "dgpp.webui"
# What each package (and everything below it) must never import.
FORBIDDEN = {
    "dgpp.kernels": ("dgpp.engine", "dgpp.appliance", "dgpp.webui"),
    "dgpp.engine": ("dgpp.appliance", "dgpp.webui"),
    "dgpp.appliance": ("dgpp.webui",),
}
# The engine's packages (and its top modules), bottom first: each may import those before it
# and never one after it.
ENGINE_LAYERS = (
    ("errors",),
    ("quant",),
    ("checkpoint",),
    ("configuration",),
    ("tokenization",),
    ("sampling",),
    ("backends",),
    ("layers",),
    ("vision",),
    ("models",),
    ("cache",),
    ("planning",),
    ("selfcheck",),
    ("scheduling",),
    ("execution",),
    ("speculative",),
    ("distributed",),
    ("engine", "async_engine", "llm", "head"),  # the front
    ("evaluation",),
    ("server",),
)
# The same inside the engine's server, the appliance and the console.
SERVER_LAYERS = (
    ("metrics", "parsers"),
    ("core", "tool_formats"),
    ("openai",),
    ("chat", "anthropic", "responses"),
    ("pipeline",),
    ("routes",),
    ("app",),
)
APPLIANCE_LAYERS = (
    ("common",),
    ("models",),
    ("deployments",),
    ("control", "runtime"),
    ("doctor",),
    ("offline",),  # a public import: `from dgpp.appliance.offline import LLM`
    ("commands",),
    ("cli",),
)
WEBUI_LAYERS = (
    ("security", "deployments", "plans"),
    ("monitor",),
    ("switch",),
    ("models",),
    ("core",),
    ("routes",),
    ("app",),
    ("cli",),
)
# Each parent's layers: for two modules under the same parent, the name right after the parent
# gives each one's layer, and neither may import a module of a later layer.
LAYERS = {
    "dgpp.engine": ENGINE_LAYERS,
    "dgpp.engine.server": SERVER_LAYERS,
    "dgpp.appliance": APPLIANCE_LAYERS,
    "dgpp.webui": WEBUI_LAYERS,
}


def layer(module: str, parent: str) -> int | None:
    """The index in `LAYERS[parent]` of a module under `parent` (None: not under it, or under
    no layer of it)."""
    if not module.startswith(parent + "."):
        return None
    name = module[len(parent) + 1 :].split(".")[0]
    for index, names in enumerate(LAYERS[parent]):
        if name in names:
            return index
    return None


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Every dgpp module by its import name."""
    modules = {}
    for folder, package in PACKAGES.items():
        for path in (root / folder).rglob("*.py"):
            parts = [p for p in path.relative_to(root / folder).with_suffix("").parts]
            modules[".".join([package, *(p for p in parts if p != "__init__")])] = path
    return modules


def imported_names(path: Path) -> set[str]:
    """Absolute import targets of a file, `from a import b` giving both `a` and `a.b`."""
    tree = ast.parse(path.read_text())
    annotations_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for statement in node.body
        for inner in ast.walk(statement)
    }
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in annotations_only:
            continue
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in names if name == "dgpp" or name.startswith("dgpp.")}


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = module_files(root)
    return {name: imported_names(path) & modules.keys() for name, path in modules.items()}


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports of a package above the importer: across the four folders (`FORBIDDEN`) and
    along each parent's layers (`LAYERS`)."""
    across = {
        f"{module} imports {target}"
        for module, targets in graph.items()
        for layer, above in FORBIDDEN.items()
        if module == layer or module.startswith(layer + ".")
        for target in targets
        if target.startswith(above)
    }
    inside = {
        f"{module} imports {target}"
        for module, targets in graph.items()
        for parent in LAYERS
        if (own := layer(module, parent)) is not None
        for target in targets
        if (above := layer(target, parent)) is not None and own < above
    }
    return sorted(across | inside)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in graph.get(module, ()):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph)))
    try:
        for module in sorted(graph):
            if module not in index:
                visit(module)
    finally:
        sys.setrecursionlimit(limit)
    return found


def test_imports_run_one_way() -> None:
    assert upward_imports(import_graph()) == []


def test_no_import_cycles() -> None:
    assert cycles(import_graph()) == []


def test_every_module_sits_in_a_layer() -> None:
    unplaced = [
        module
        for module in module_files()
        for parent in LAYERS
        if module.startswith(parent + ".") and layer(module, parent) is None
    ]
    assert unplaced == []


def test_the_checks_see_an_upward_import_and_a_late_import_cycle(tmp_path: Path) -> None:
    (tmp_path / "kernels").mkdir()
    (tmp_path / "engine" / "layers").mkdir(parents=True)
    (tmp_path / "engine" / "backends").mkdir()
    (tmp_path / "engine" / "backends" / "e.py").write_text("from dgpp.engine.layers import b\n")
    # Inside the server: parsers may not import routes; routes may import the engine below.
    for folder in ("parsers", "routes"):
        (tmp_path / "engine" / "server" / folder).mkdir(parents=True)
    (tmp_path / "engine" / "server" / "parsers" / "f.py").write_text(
        "from dgpp.engine.server.routes.g import route\n"
    )
    (tmp_path / "engine" / "server" / "routes" / "g.py").write_text(
        "from dgpp.engine.layers import b\n"
    )
    for folder in ("appliance", "webui"):
        (tmp_path / folder).mkdir()
    (tmp_path / "kernels" / "a.py").write_text("from dgpp.engine.layers import b\n")
    (tmp_path / "engine" / "layers" / "b.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from dgpp.appliance import c\n"
        "def late():\n    from dgpp.kernels import a\n"
    )
    (tmp_path / "appliance" / "c.py").write_text("import dgpp.webui.d\n")
    (tmp_path / "webui" / "d.py").write_text("")
    graph = import_graph(tmp_path)
    assert upward_imports(graph) == [
        "dgpp.appliance.c imports dgpp.webui.d",
        "dgpp.engine.backends.e imports dgpp.engine.layers.b",
        "dgpp.engine.server.parsers.f imports dgpp.engine.server.routes.g",
        "dgpp.kernels.a imports dgpp.engine.layers.b",
    ]
    assert cycles(graph) == [["dgpp.engine.layers.b", "dgpp.kernels.a"]]
