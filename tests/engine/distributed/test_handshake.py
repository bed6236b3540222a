"""The configuration rank 0 pushes: digest, version, per-key differences and the resolved facts
workers build from (no world needed)."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.configuration.engine_config import EngineConfig
from dgpp.engine.distributed.handshake import (
    WorldConfig,
    check,
    config_digest,
    differences,
    software_version,
)
from dgpp.engine.distributed.worker import pushed_config
from dgpp.engine.errors import ModelLoadError
from dgpp.engine.planning.resolved import resolve
from tests.conftest import tiny_model

CONFIG = {"engine": {"model": "default", "kv_capacity": 2048}, "world_size": 2}


def test_digest_ignores_key_order_and_sees_every_value() -> None:
    reordered = {"world_size": 2, "engine": {"kv_capacity": 2048, "model": "default"}}
    assert config_digest(CONFIG) == config_digest(reordered)
    changed = {"engine": {"model": "default", "kv_capacity": 2049}, "world_size": 2}
    assert config_digest(CONFIG) != config_digest(changed)


def test_a_matching_configuration_is_accepted() -> None:
    pushed = WorldConfig.of(CONFIG)
    assert check(pushed, None) is None
    assert check(pushed, {"world_size": 2, "engine": {"kv_capacity": 2048}}) is None


def test_another_software_version_is_refused_by_name() -> None:
    pushed = replace(WorldConfig.of(CONFIG), version="dgpp 0.0.1, torch 1.0")
    refusal = check(pushed, None)
    assert refusal == (
        f"software differs: rank 0 runs dgpp 0.0.1, torch 1.0, this rank {software_version()}"
    )


def test_a_damaged_configuration_is_refused() -> None:
    pushed = replace(WorldConfig.of(CONFIG), config={**CONFIG, "world_size": 4})
    assert check(pushed, None) == "the configuration arrived damaged (digest mismatch)"


def test_differences_name_each_key_path() -> None:
    expected = {"world_size": 4, "engine": {"kv_capacity": 1024, "model": "default", "seed": 1}}
    assert differences(expected, CONFIG) == [
        "world_size: this rank has 4, rank 0 has 2",
        "engine.kv_capacity: this rank has 1024, rank 0 has 2048",
        "engine.seed: this rank has 1, rank 0 has '<absent>'",
    ]
    refusal = check(WorldConfig.of(CONFIG), expected)
    assert refusal is not None and refusal.startswith("configuration differs: world_size")


def test_one_line_drops_the_source_location_and_stays_short() -> None:
    from dgpp.engine.errors import one_line

    gloo = RuntimeError(
        "[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
        "peer [127.0.0.1]:29585. " + "x" * 300 + "\nsecond line"
    )
    line = one_line(gloo)
    assert line.startswith("RuntimeError: Connection closed by peer [127.0.0.1]:29585.")
    assert len(line) == 160 and line.endswith("…")
    assert one_line(ValueError("")) == "ValueError: "
    assert one_line(None) == "unknown error"


def test_workers_build_from_the_facts_rank_0_resolved(tmp_path: Path) -> None:
    """Rank 0 pushes its reading of config.json with the sized engine configuration, as plain
    data; a worker builds its model facts from that, not from its own copy of the file."""
    tiny_llama = tmp_path / "checkpoint"
    tiny_model("LlamaForCausalLM").save_pretrained(str(tiny_llama), safe_serialization=True)
    resolved = resolve(EngineConfig(model=str(tiny_llama), kv_capacity=256), tiny_llama, 2)
    pushed = json.loads(json.dumps(pushed_config(resolved, "dep-1")))  # what crosses the wire
    assert pushed["engine"]["kv_capacity"] == 256 and pushed["world_size"] == 2
    assert pushed["engine"]["max_model_len"] == resolved.max_model_len
    node_copy = tiny_llama.parent / "node-copy"
    shutil.copytree(tiny_llama, node_copy)
    (node_copy / "config.json").write_text("{ damaged")
    worker_facts = ModelConfig.from_checkpoint(node_copy, raw=pushed["model"])
    assert worker_facts == resolved.model
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        ModelConfig.from_checkpoint(node_copy)
