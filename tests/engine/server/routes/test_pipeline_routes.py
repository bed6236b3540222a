"""Every generating route runs the one pipeline (engine/server/pipeline/pipeline.py): it prepares a
GenerationJob and completes or streams it there; none builds SamplingParams itself, talks to
the engine's generation directly, or runs a stream loop of its own."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SERVER = Path(__file__).resolve().parents[4] / "engine" / "server" / "routes"
ROUTES = ["chat_routes.py", "completion_routes.py", "anthropic_routes.py", "responses_routes.py"]


def _names(tree: ast.AST) -> tuple[set[str], set[str]]:
    """The functions called and the modules imported from."""
    called = {
        node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
    }
    imported = {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    return called, imported


@pytest.mark.parametrize("module", ROUTES)
def test_the_route_runs_the_pipeline(module: str) -> None:
    tree = ast.parse((SERVER / module).read_text())
    called, imported = _names(tree)
    assert "prepare" in called and "stream_response" in called and "complete" in called
    assert "SamplingParams" not in called and "sampling_params" not in called
    assert "dgpp.engine.server.pipeline.generation" not in imported
    assert not {"stream_choices", "run_to_completion", "StreamingResponse"} & called
    loops = [node for node in ast.walk(tree) if isinstance(node, ast.AsyncFor)]
    assert loops == [], f"{module} runs a stream loop of its own"
