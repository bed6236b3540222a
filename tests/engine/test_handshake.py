"""The configuration rank 0 pushes: digest, version and per-key differences (no world needed)."""

from __future__ import annotations

from dataclasses import replace

from dgpp.engine.distributed.handshake import (
    WorldConfig,
    check,
    config_digest,
    differences,
    software_version,
)

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
