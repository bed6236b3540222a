"""The side models in the memory plan (`dgpp deploy plan`): per node, the main model's rank, every
`always` side model and the largest on-demand one must fit, and `side_memory_gib` must hold the
side models; a deployment that cannot hold them is refused naming what does not fit. Planned
from the facts shipped for the templates' models (nothing downloaded)."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from dgpp.appliance import cli
from dgpp.appliance.deployments.deployment import parse_deployment
from dgpp.appliance.deployments.plan import (
    model_config_of,
    plan_deployment,
    resolve_deployment,
    spark_memory,
)
from dgpp.appliance.deployments.side_plan import plan_side_models, refuse_unfit_sides
from dgpp.engine.errors import ConfigError

GPU = {"device": "cuda", "dtype": "bfloat16"}
MAIN = {"model": "Qwen/Qwen3-30B-A3B", "engine": {"kv_capacity": 65536, **GPU}}


def _nodes(raw: dict) -> list:
    deployment = parse_deployment(raw)
    model, _ = model_config_of(deployment)
    memory = spark_memory()
    plans = plan_deployment(resolve_deployment(deployment, model, memory), memory)
    return plan_side_models(deployment, plans, memory)


def test_always_ones_and_the_largest_on_demand_one_are_counted_per_node() -> None:
    sides = [
        {"name": "fast", "model": "Qwen/Qwen3-8B", "load": "always",
         "engine": {"kv_capacity": 8192, **GPU}},
        {"name": "emb", "model": "x", "kind": "embed", "memory_gib": 2},
        {"name": "rr", "model": "y", "kind": "rerank", "memory_gib": 3},
    ]  # fmt: skip
    (node,) = _nodes({**MAIN, "side_models": sides})
    assert [cost.side.name for cost in node.always] == ["fast"]
    assert node.always[0].source == "plan" and node.always[0].bytes > 16 * 10**9  # 8B, bf16
    assert node.on_demand is not None and node.on_demand.side.name == "rr"  # the larger
    assert node.side_bytes == node.always[0].bytes + 3 * (1 << 30)
    assert not node.problems()


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"side_models": [{"name": "big", "model": "Qwen/Qwen2.5-72B-Instruct", "engine": GPU}]},
         "side models big (largest on demand)"),
        ({"side_models": [{"name": "a", "model": "x", "memory_gib": 4, "load": "always"}],
          "side_memory_gib": 2}, "side_memory_gib holds 2.00 GiB"),
        ({"side_models": [{"name": "a", "model": "/nowhere/at/all"}]},
         "no memory known for a: set memory_gib"),
    ],
)  # fmt: skip
def test_a_deployment_that_cannot_hold_its_side_models_is_refused(extra: dict, says: str) -> None:
    nodes = _nodes({**MAIN, **extra})
    with pytest.raises(ConfigError, match="the side models do not fit: node 0: ") as refused:
        refuse_unfit_sides(nodes)
    assert says in str(refused.value)


def test_deploy_plan_prints_the_side_models_and_exits_non_zero_when_they_do_not_fit(
    tmp_path: Path,
) -> None:
    path = tmp_path / "d.json"
    sides = [{"name": "big", "model": "Qwen/Qwen2.5-72B-Instruct"}]
    path.write_text(json.dumps({**MAIN, "side_models": sides}))
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = cli.main(["deploy", "plan", str(path)])
    assert code != 0
    assert "| 0 | " in out.getvalue() and "big " in out.getvalue()
    assert "largest on demand" in out.getvalue()
