"""Command-line flags for the knobs (`dgpp.engine.configuration.knobs`), derived from their
declarations: every command that starts an engine takes `EngineConfig`'s, `dgpp serve` also
`ServerConfig`'s."""

from __future__ import annotations

import argparse
import json
from typing import Any, get_origin

from dgpp.engine.configuration.engine_config import EngineConfig
from dgpp.engine.configuration.knobs import Knob, default_text, knobs_of
from dgpp.engine.server.core.config import ServerConfig


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model",
        default=None,
        help="checkpoint dir or GGUF file, HF repo id, 'default' (the default: SmolLM2's Q4_1 "
        "GGUF) or 'default:float32' (its float32 expansion)",
    )
    add_knob_flags(group, EngineConfig)


def add_knob_flags(group: argparse._ArgumentGroup, cls: type) -> None:
    """One flag per knob of `cls` that has one; unset flags stay None (the knob's default, or
    what the deployment file says)."""
    for each in knobs_of(cls):
        if each.flag is not None:
            _add_flag(group, each)


def _add_flag(group: argparse._ArgumentGroup, each: Knob) -> None:
    text = f"{each.help} (default: {default_text(each)})".replace("%", "%%")
    options: dict[str, Any] = {"dest": each.name, "default": None, "help": text}
    if each.base is bool:
        options["action"] = argparse.BooleanOptionalAction
    elif each.choices:
        options["choices"] = [str(choice) for choice in each.choices]
    elif get_origin(each.base) is tuple:
        options.update(action="append", metavar="NAME", help=f"{text}; repeatable")
    elif get_origin(each.base) is dict:
        options.update(type=_json_object, metavar="JSON")
    else:
        options["type"] = each.base
    assert each.flag is not None
    group.add_argument(each.flag, **options)
    if each.negation is not None:
        flag, value = each.negation
        group.add_argument(
            flag,
            dest=each.name,
            action="store_const",
            const=value,
            help=f"{each.name} {value}, whatever the deployment says",
        )


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not JSON: {err}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def knob_flags(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The knobs of `cls` the command line set, as `cls`'s keyword arguments."""
    values = {}
    for each in knobs_of(cls):
        value = getattr(args, each.name, None) if each.flag is not None else None
        if value is not None:
            values[each.name] = tuple(value) if isinstance(value, list) else value
    return values


def engine_knobs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine knobs the user set, as `EngineConfig` keyword arguments."""
    return knob_flags(args, EngineConfig)


def deployment_overrides(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The knobs the command line set, as deployment sections ({"engine": {...}, ...})."""
    sections: dict[str, dict[str, Any]] = {}
    for cls in (EngineConfig, ServerConfig):
        by_name = {each.name: each for each in knobs_of(cls)}
        for name, value in knob_flags(args, cls).items():
            where = by_name[name].deployment
            if where is not None:
                section, key = where.split(".", 1)
                sections.setdefault(section, {})[key] = (
                    list(value) if isinstance(value, tuple) else value
                )
    return sections


def add_sampling_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=256)
    group.add_argument("--temperature", type=float, default=0.0)
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "repetition_penalty": args.repetition_penalty,
        "seed": args.sample_seed,
        "stop": tuple(args.stop),
    }
