"""Knobs are declared once (dgpp.engine.configuration.knobs): the dataclass, the deployment schema,
the CLI flags, the console's form and docs/engine.md's table all agree because they are derived, and
a new knob reaches every one of them from its field alone."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, get_origin

import pytest

from dgpp.appliance.cli import build_parser
from dgpp.appliance.commands.engine_options import add_knob_flags, knob_flags
from dgpp.appliance.commands.serve import serve_deployment
from dgpp.appliance.deployments.deployment import (
    Deployment,
    engine_config,
    parse_deployment,
    server_config,
    world_timeouts,
)
from dgpp.appliance.deployments.knob_schema import key_of, section_model
from dgpp.engine.configuration.engine_config import EngineConfig
from dgpp.engine.configuration.knobs import Knob, Rule, check_knobs, knob, knob_table, knobs_of
from dgpp.engine.errors import ConfigError
from dgpp.engine.llm import _KNOBS
from dgpp.engine.server.core.config import ServerConfig
from dgpp.webui.deployments.knob_form import knob_fields
from scripts.knob_table import CLASSES, DOC, rendered

# Strings have no generic "another valid value": these are.
STRINGS = {
    "device": "cuda:1",
    "host": "127.0.0.2",
    "tokenizer": "/tok",
    "resident_cache_dir": "/r",
    "prefix_cache_dir": "/var/cache/dgpp/prefix",
    "uds": "/run/dgpp/side.sock",
}
# Knobs a rule (`Rule`) ties to another: that one's value goes with theirs.
COMPANIONS: dict[str, dict[str, Any]] = {"prefix_cache_disk_gib": {"prefix_cache_host_gib": 2.0}}
ALL = [each for cls in CLASSES for each in knobs_of(cls)]
OWNER = {each.name: cls for cls in CLASSES for each in knobs_of(cls)}


def sample(each: Knob) -> Any:
    """A valid value other than the default."""
    default = each.default_value
    if each.choices:
        return next(choice for choice in each.choices if choice != default)
    base = each.base
    if base is bool:
        return not default
    if base is str:
        return STRINGS[each.name]
    if get_origin(base) is tuple:
        return ("alpha", "beta")
    if get_origin(base) is dict:
        return {"enable_thinking": False}
    if default is None:
        start = each.ge if each.ge is not None else each.gt if each.gt is not None else 0
        value = base(start) + 1 if each.le is None else each.le / 2
    else:
        value = default + 1 if base is int else default * 2 or 1.5
    if each.le is not None and value > each.le:
        value = each.le - 1 if base is int else each.le / 3
    return base(value)


def flag_args(each: Knob, value: Any) -> list[str]:
    assert each.flag is not None
    if each.base is bool:
        return [each.flag if value else f"--no-{each.flag[2:]}"]
    if get_origin(each.base) is tuple:
        return [arg for name in value for arg in (each.flag, name)]
    if get_origin(each.base) is dict:
        return [each.flag, json.dumps(value)]
    return [each.flag, str(value)]


def configured(deployment: Deployment, each: Knob) -> Any:
    cls = OWNER[each.name]
    if cls is EngineConfig:
        return getattr(engine_config(deployment), each.name)
    if cls is ServerConfig:
        return getattr(server_config(deployment), each.name)
    return getattr(world_timeouts(deployment), each.name)


def test_the_docs_table_is_the_declarations() -> None:
    assert DOC.read_text() == rendered(DOC.read_text()), "run scripts/knob_table.py"


def test_every_knob_is_checked_by_its_own_dataclass() -> None:
    for each in ALL:
        cls = OWNER[each.name]
        kwargs = {"model": "m"} if cls is EngineConfig else {}
        config = cls(**kwargs, **COMPANIONS.get(each.name, {}), **{each.name: sample(each)})
        assert getattr(config, each.name) == sample(each)
    assert {each.name for each in knobs_of(EngineConfig)} == _KNOBS  # LLM(**knobs)


@pytest.mark.parametrize("each", [e for e in ALL if e.deployment], ids=lambda e: e.name)
def test_a_knob_set_in_the_deployment_reaches_its_dataclass(each: Knob) -> None:
    section, key = each.deployment.split(".")
    default = parse_deployment({"model": "m"})
    assert getattr(getattr(default, section), key) == each.default_value
    value = sample(each)
    plain = list(value) if isinstance(value, tuple) else value
    deployment = parse_deployment(
        {"model": "m", section: {key: plain, **COMPANIONS.get(each.name, {})}}
    )
    assert configured(deployment, each) == value


@pytest.mark.parametrize("each", [e for e in ALL if e.flag], ids=lambda e: e.name)
def test_a_knob_set_by_its_flag_reaches_its_dataclass(each: Knob) -> None:
    value = sample(each)
    companions = [
        arg
        for name, other in COMPANIONS.get(each.name, {}).items()
        for arg in flag_args(next(e for e in ALL if e.name == name), other)
    ]
    args = build_parser().parse_args(["serve", *flag_args(each, value), *companions])
    assert configured(serve_deployment(args), each) == value
    unset = build_parser().parse_args(["serve"])
    assert getattr(unset, each.name) is None  # an unset flag leaves the deployment's value


def _outside(each: Knob) -> list[Any]:
    step = 1 if each.base is int else 0.5
    values = []
    if each.ge is not None:
        values.append(each.base(each.ge - step))
    if each.gt is not None:
        values.append(each.base(each.gt))
    if each.le is not None:
        values.append(each.base(each.le + step))
    return values


BOUNDED = [(each, value) for each in ALL for value in _outside(each)]


@pytest.mark.parametrize(("each", "value"), BOUNDED, ids=[f"{e.name}={v}" for e, v in BOUNDED])
def test_a_value_out_of_bounds_is_refused_everywhere(each: Knob, value: Any) -> None:
    cls = OWNER[each.name]
    with pytest.raises(ConfigError, match=each.name):
        cls(**({"model": "m"} if cls is EngineConfig else {}), **{each.name: value})
    if each.deployment:
        section, key = each.deployment.split(".")
        with pytest.raises(ConfigError, match=f"{section}.{key}"):
            parse_deployment({"model": "m", section: {key: value}})


def test_a_pattern_is_refused_in_the_knobs_words() -> None:
    with pytest.raises(
        ConfigError, match=r"engine.device: must be cpu, cuda or cuda:N \(got 'gpu'\)"
    ):
        parse_deployment({"model": "m", "engine": {"device": "gpu"}})
    with pytest.raises(ConfigError, match=r"^device must be cpu, cuda or cuda:N, got 'gpu'$"):
        EngineConfig(model="m", device="gpu")


def test_the_rules_hold_in_the_file_and_the_dataclass() -> None:
    with pytest.raises(ConfigError, match=r"spec_ngram_min \(5\) must not exceed"):
        EngineConfig(model="m", spec_ngram_min=5, spec_ngram_max=4)
    with pytest.raises(ConfigError, match=r"speculative: .*ngram_min \(5\) must not exceed"):
        parse_deployment({"model": "m", "speculative": {"ngram_min": 5, "ngram_max": 4}})


def test_the_console_shows_every_labelled_knob() -> None:
    labelled = {each.deployment for each in ALL if each.label}
    assert {field.path for field in knob_fields()} == labelled
    assert all(each.deployment for each in ALL if each.label)  # the form writes the file
    assert {"engine.kv_capacity", "engine.max_model_len", "engine.prefill_precision"} <= labelled


def test_the_schema_sections_hold_only_knobs() -> None:
    hand_written = {"api_key_file", "admin_key_file", "allow_unauthenticated", "api_keys"}
    for section in ("engine", "speculative", "resident_cache", "timeouts", "http"):
        model = Deployment.model_fields[section].annotation
        declared = {key_of(each) for each in ALL if (each.deployment or "").startswith(section)}
        assert set(model.model_fields) - hand_written == declared, section


@dataclass(frozen=True)
class _Toy:
    """A configuration with a knob no other code knows."""

    KNOB_SECTION: ClassVar[str] = "toy"
    RULES: ClassVar[tuple[Rule, ...]] = (
        Rule(("low", "depth"), lambda low, depth: low <= depth, "{0} ({v0}) exceeds {1} ({v1})"),
    )

    depth: int = knob(
        3,
        "how deep the toy goes",
        label="Depth",
        group="scheduling",
        unit="levels",
        ge=1,
        le=8,
        live=True,
    )
    low: int = knob(1, "the shallowest level", ge=0)
    mode: Literal["a", "b"] = knob("a", "which toy", flag="--toy-mode")

    def __post_init__(self) -> None:
        check_knobs(self)


def test_a_new_knob_needs_no_other_edit() -> None:
    section = section_model("ToySection", "toy", _Toy)
    assert section().model_dump() == {"depth": 3, "low": 1, "mode": "a"}
    with pytest.raises(ValueError, match="less than or equal to 8"):
        section(depth=9)
    with pytest.raises(ValueError, match=r"low \(4\) exceeds depth \(3\)"):
        section(low=4)
    with pytest.raises(ConfigError, match=r"depth must be in \[1, 8\], got 9"):
        _Toy(depth=9)
    parser = argparse.ArgumentParser()
    add_knob_flags(parser.add_argument_group("toy"), _Toy)
    args = parser.parse_args(["--depth", "5", "--toy-mode", "b"])
    assert knob_flags(args, _Toy) == {"depth": 5, "mode": "b"}
    with pytest.raises(SystemExit):
        parser.parse_args(["--toy-mode", "c"])
    table = knob_table(_Toy)
    assert (
        "| `depth` | 3 levels | `toy.depth` | `--depth` | Depth | yes | how deep the toy" in table
    )
