"""The deployment schema: strict types, key paths in every error, and what it turns into."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dgpp.appliance.commands.timeout_env import apply_env_overrides
from dgpp.appliance.deployments.deployment import (
    engine_config,
    parse_deployment,
    server_config,
    world_spec,
    world_timeouts,
)
from dgpp.appliance.deployments.files import resolve
from dgpp.engine.distributed.world_spec import WorldTimeouts
from dgpp.engine.errors import ConfigError, ModelLoadError


def test_minimal_deployment_takes_the_defaults() -> None:
    deployment = parse_deployment({"model": "default"})
    config = engine_config(deployment)
    assert (config.model, config.kv_capacity, config.resident_cache) == ("default", 16384, True)
    assert server_config(deployment).served_model_names == ("default",)
    spec = world_spec(deployment, 0, world_timeouts(deployment))
    assert (spec.world_size, spec.backend, spec.port) == (1, "gloo", 29517)


def test_every_section_reaches_its_configuration() -> None:
    deployment = parse_deployment(
        {
            "model": "/models/qwen",
            "world_size": 2,
            "engine": {"kv_capacity": 4096, "device": "cuda", "prefill_precision": "model"},
            "http": {"port": 9000, "served_model_names": ["q", "q2"]},
            "rendezvous": {"head": "10.0.0.1", "port": 4000},
            "timeouts": {"collective_s": 60, "heartbeat_s": 2},
            "resident_cache": {"enabled": False, "dir": "/var/cache/dgpp"},
            "speculative": {"method": "ngram", "depth": 6, "ngram_min": 1},
        }
    )
    config = engine_config(deployment)
    assert (config.speculative, config.spec_depth, config.spec_ngram_min) == ("ngram", 6, 1)
    assert config.spec_ngram_max == 4
    assert (config.kv_capacity, config.device, config.prefill_precision) == (4096, "cuda", "model")
    assert (config.resident_cache, config.resident_cache_dir) == (False, "/var/cache/dgpp")
    server = server_config(deployment, api_key="k")
    assert (server.port, server.served_model_names, server.api_key) == (9000, ("q", "q2"), "k")
    head = world_spec(deployment, 0, world_timeouts(deployment))
    assert (head.head, head.port, head.world_size, head.backend) == ("10.0.0.1", 4000, 2, "nccl")
    assert head.timeouts.collective_s == 60 and head.timeouts.heartbeat_s == 2
    assert world_spec(deployment, 1, head.timeouts).world_size is None  # workers learn it


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({}, "model: required"),
        ({"model": "m", "engine": {"kv_capcity": 1}}, "engine.kv_capcity: unknown key"),
        ({"model": "m", "bogus": 1}, "bogus: unknown key"),
        ({"model": "m", "engine": {"kv_capacity": "big"}}, "engine.kv_capacity: Input should"),
        ({"model": "m", "engine": {"kv_capacity": 0}}, "engine.kv_capacity: Input should be"),
        ({"model": "m", "engine": {"prefix_cache": "yes"}}, "engine.prefix_cache:"),
        ({"model": "m", "engine": {"prefix_min_tokens": -1}}, "engine.prefix_min_tokens:"),
        ({"model": "m", "engine": {"prefix_cache_gib": "4"}}, "engine.prefix_cache_gib:"),
        ({"model": "m", "engine": {"prefix_cache_gib": True}}, "engine.prefix_cache_gib:"),
        (
            {"model": "m", "engine": {"prefix_cache_gib": -0.5}},
            "engine.prefix_cache_gib: Input should be greater than or equal to 0",
        ),
        (
            {"model": "m", "engine": {"prefill_precision": "fp16"}},
            "engine.prefill_precision: must be one of 'fp32' or 'model' (got 'fp16')",
        ),
        (
            {"model": "m", "engine": {"device": "tpu"}},
            "engine.device: must be cpu, cuda or cuda:N (got 'tpu')",
        ),
        ({"model": "m", "rendezvous": {"port": 70000}}, "rendezvous.port:"),
        ({"model": "m", "world_size": 0}, "world_size:"),
        ({"model": "m", "http": {"served_model_names": "x"}}, "http.served_model_names:"),
        (
            {"model": "m", "speculative": {"method": "eagle"}},
            "speculative.method: must be one of 'off', 'ngram' or 'mtp' (got 'eagle')",
        ),
        ({"model": "m", "speculative": {"depth": 0}}, "speculative.depth: Input should be"),
        ({"model": "m", "speculative": {"draft": 1}}, "speculative.draft: unknown key"),
        (
            {"model": "m", "speculative": {"ngram_min": 5, "ngram_max": 3}},
            "speculative: Value error, ngram_min (5) must not exceed ngram_max (3)",
        ),
    ],
)
def test_bad_deployments_name_the_key(raw: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match="deployment is invalid") as info:
        parse_deployment(raw)
    assert message in str(info.value)


def test_inconsistent_timeouts_are_refused() -> None:
    # The rule is declared once (WorldTimeouts.RULES) and holds in the file and in the dataclass.
    with pytest.raises(ConfigError, match=r"timeouts: .*heartbeat_s \(61.0\) must be at most half"):
        parse_deployment({"model": "m", "timeouts": {"heartbeat_s": 61}})
    with pytest.raises(ConfigError, match=r"timeouts.heartbeat_s \(61\) must be at most half"):
        WorldTimeouts(heartbeat_s=61)


def test_load_reports_unreadable_and_invalid_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the deployment"):
        resolve(tmp_path / "absent.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        resolve(bad)
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"model": "default", "world_size": 4}))
    assert resolve(good).world_size == 4


def test_environment_overrides_the_three_legacy_deadlines() -> None:
    environ = {
        "DGPP_BOUNDARY_TIMEOUT_MS": "600000",
        "DGPP_CONSUMER_DEADLINE_S": "300",
        "DGPP_BUS_COMPLETION_TIMEOUT_MS": "120000",
    }
    timeouts = apply_env_overrides(WorldTimeouts(), environ)
    assert (timeouts.collective_s, timeouts.control_deadline_s, timeouts.step_watchdog_s) == (
        600.0,
        300.0,
        120.0,
    )
    assert apply_env_overrides(WorldTimeouts(), {}) == WorldTimeouts()


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"DGPP_BOUNDARY_TIMEOUT_MS": "soon"}, "DGPP_BOUNDARY_TIMEOUT_MS must be a number"),
        ({"DGPP_CONSUMER_DEADLINE_S": "-1"}, "DGPP_CONSUMER_DEADLINE_S must be positive"),
        ({"DGPP_CONSUMER_DEADLINE_S": "1.5"}, "at most half"),
    ],
)
def test_bad_environment_overrides_are_refused(environ: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        apply_env_overrides(WorldTimeouts(), environ)


def test_models_dir_is_searched_first(tmp_path: Path, default_checkpoint: Path) -> None:
    from dgpp.appliance.deployments.deployment import checkpoint_of

    mounted = tmp_path / "nfs" / "Qwen3-8B"
    mounted.mkdir(parents=True)
    deployment = parse_deployment(
        {"model": "Qwen/Qwen3-8B", "paths": {"models_dir": str(tmp_path / "nfs")}}
    )
    assert checkpoint_of(deployment) == mounted
    # The default model is never shadowed, and a missing entry falls back to the model store.
    default = parse_deployment({"model": "default", "paths": {"models_dir": str(tmp_path)}})
    assert checkpoint_of(default) == default_checkpoint
    with pytest.raises(ModelLoadError):
        checkpoint_of(parse_deployment({"model": "nope/absent", "paths": {"models_dir": "/x"}}))


def test_command_line_speculation_flags_override_the_deployment(tmp_path: Path) -> None:
    from dgpp.appliance.cli import build_parser
    from dgpp.appliance.commands.serve import serve_deployment

    path = tmp_path / "d.json"
    path.write_text(json.dumps({"model": "default", "speculative": {"method": "ngram"}}))

    def effective(*flags: str) -> tuple[str, int]:
        args = build_parser().parse_args(["serve", "--deployment", str(path), *flags])
        config = engine_config(serve_deployment(args))
        return config.speculative, config.spec_depth

    assert effective() == ("ngram", 4)
    assert effective("--no-spec") == ("off", 4)  # clears what the file set
    assert effective("--spec-depth", "7") == ("ngram", 7)
    path.write_text(json.dumps({"model": "default"}))
    assert effective("--spec", "ngram") == ("ngram", 4)


def test_prefix_cache_knobs_reach_the_engine_and_the_flags_override_them(tmp_path: Path) -> None:
    from dgpp.appliance.cli import build_parser
    from dgpp.appliance.commands.serve import serve_deployment

    config = engine_config(parse_deployment({"model": "m"}))
    assert (config.prefix_min_tokens, config.prefix_cache_gib) == (1024, 4.0)
    raw = {"model": "default", "engine": {"prefix_min_tokens": 512, "prefix_cache_gib": 2}}
    config = engine_config(parse_deployment(raw))  # a whole number of GiB is a float too
    assert (config.prefix_min_tokens, config.prefix_cache_gib) == (512, 2)
    path = tmp_path / "d.json"
    path.write_text(json.dumps(raw))

    def effective(*flags: str) -> tuple[int, float]:
        args = build_parser().parse_args(["serve", "--deployment", str(path), *flags])
        config = engine_config(serve_deployment(args))
        return config.prefix_min_tokens, config.prefix_cache_gib

    assert effective() == (512, 2.0)
    assert effective("--prefix-cache-gib", "0.5", "--prefix-min-tokens", "64") == (64, 0.5)
    assert effective("--prefix-cache-gib", "0") == (512, 0.0)  # no snapshots at all


def test_served_name_patterns_and_the_max_tokens_policy_reach_the_server() -> None:
    deployment = parse_deployment(
        {"model": "/models/qwen", "http": {"served_model_names": ["claude-*", "*"]}}
    )
    server = server_config(deployment)
    assert server.served_model_names == ("qwen", "claude-*", "*")  # a name to report comes first
    assert server.max_tokens_policy == "clamp"
    named = parse_deployment(
        {"model": "m", "http": {"served_model_names": ["q", "*"], "max_tokens_policy": "reject"}}
    )
    assert server_config(named).served_model_names == ("q", "*")
    assert server_config(named).max_tokens_policy == "reject"
    with pytest.raises(ConfigError, match="max_tokens_policy"):
        parse_deployment({"model": "m", "http": {"max_tokens_policy": "truncate"}})


def test_serve_flags_set_name_patterns_and_the_max_tokens_policy() -> None:
    from dgpp.appliance.cli import build_parser
    from dgpp.appliance.commands.serve import serve_deployment

    flags = ["serve", "--served-model-name", "*", "--max-tokens-policy", "reject"]
    server = server_config(serve_deployment(build_parser().parse_args(flags)))
    assert (server.served_model_names, server.max_tokens_policy) == (("default", "*"), "reject")
