"""Knobs, declared once. A knob is a field of a frozen configuration dataclass (`EngineConfig`,
`ServerConfig`, `WorldTimeouts`) made with `knob(...)`: its name, type (the annotation, a
`Literal` for choices), default, bounds, unit, help, where it may be set (the deployment
file's key, the command-line flag, the console's form) and whether a running rank 0 takes a
new value live (`live`: a reload, no restart; `dgpp.appliance.runtime.live_reload`). Everything
else is derived from that field: the dataclass's own checks (`check_knobs`), the deployment
schema's sections (`dgpp.appliance.deployments.knob_schema`), the CLI flags
(`dgpp.appliance.commands.engine_options`), the console's form
(`dgpp.webui.deployments.knob_form`) and the knob table of docs/engine.md (`knob_table`).

Adding a knob is one edit: the field. Rules that tie knobs together (`Rule`) are declared once
too, beside the fields, and checked wherever the knobs are.
"""

from __future__ import annotations

import dataclasses
import re
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from dgpp.engine.errors import ConfigError

_SAME = "="  # `deployment` / `flag` left at their default: derived from the knob's name

# What a console knob governs, in the form's order (its sections): every labelled knob names
# one, and says whether it is common or folded under the section's "advanced".
GROUPS: dict[str, str] = {
    "memory": "Memory and context",
    "scheduling": "Scheduling",
    "prefix": "Prefix cache",
    "speculative": "Speculative decoding",
    "api": "API behaviour",
    "timeouts": "Timeouts and health",
}


@dataclass(frozen=True)
class Knob:
    name: str  # the dataclass field (and `LLM(**knobs)` keyword)
    annotation: Any  # the resolved type
    default: Any
    help: str  # one line: the CLI's help, the console's hint, the docs table's meaning
    label: str = ""  # the console's label; "" keeps the knob off the console
    unit: str = ""
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    pattern: str | None = None  # for strings: what fullmatch must accept
    allowed: str = ""  # for a pattern: the accepted values, in words
    when_unset: str = ""  # for an optional knob: what None means
    deployment: str | None = None  # the deployment file's key ("engine.kv_capacity"); None: none
    flag: str | None = None  # the command-line flag ("--kv-capacity"); None: none
    negation: tuple[str, Any] | None = None  # a second flag, and the value it sets
    factory: Callable[[], Any] | None = None  # a mutable default's factory
    # A running rank 0 takes a new value without a restart (a reload): the knob is read only
    # by rank 0's scheduler or HTTP server, never by the other ranks or to size memory.
    live: bool = False
    group: str = ""  # the console's section (`GROUPS`); required with a label
    advanced: bool = False  # folded under the section's "advanced" on the console

    @property
    def optional(self) -> bool:
        args = get_args(self.annotation)
        return get_origin(self.annotation) in (Union, types.UnionType) and type(None) in args

    @property
    def base(self) -> Any:
        """The type without `None`: int, float, bool, str, a Literal, tuple[str, ...], dict."""
        if not self.optional:
            return self.annotation
        return next(arg for arg in get_args(self.annotation) if arg is not type(None))

    @property
    def choices(self) -> tuple[Any, ...]:
        return get_args(self.base) if get_origin(self.base) is Literal else ()

    @property
    def default_value(self) -> Any:
        return self.factory() if self.factory is not None else self.default

    @property
    def bounds_text(self) -> str:
        """The bounds in words: "a positive integer", "positive", ">= 0", "in (0, 1]"."""
        ge, gt, le = self.ge, self.gt, self.le
        if le is None:
            if ge == 1 and self.base is int:
                return "a positive integer"
            if gt == 0:
                return "positive"
            return f">= {_num(ge)}" if ge is not None else f"> {_num(gt)}" if gt is not None else ""
        low = f"[{_num(ge)}" if ge is not None else f"({_num(gt)}" if gt is not None else "(-inf"
        return f"in {low}, {_num(le)}]"


def _num(value: float | None) -> str:
    return str(int(value)) if value is not None and float(value).is_integer() else f"{value}"


def knob(
    default: Any,
    help: str,
    *,
    label: str = "",
    unit: str = "",
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    pattern: str | None = None,
    allowed: str = "",
    when_unset: str = "",
    deployment: str | None = _SAME,
    flag: str | None = _SAME,
    negation: tuple[str, Any] | None = None,
    factory: Callable[[], Any] | None = None,
    live: bool = False,
    group: str = "",
    advanced: bool = False,
) -> Any:
    """A knob's dataclass field. `deployment` is "section.key" (or "section" for the knob's own
    name in it; None: not in the file); `flag` defaults to `--the-name` (None: no flag). A knob
    with a console `label` names its `group` there (`GROUPS`)."""
    if label and group not in GROUPS:
        raise ValueError(f"console knob {label!r} needs a group, one of {', '.join(GROUPS)}")
    spec = dict(
        help=help, label=label, unit=unit, ge=ge, gt=gt, le=le, pattern=pattern,
        allowed=allowed, when_unset=when_unset, deployment=deployment, flag=flag,
        negation=negation, factory=factory, live=live, group=group, advanced=advanced,
    )  # fmt: skip
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata={"knob": spec})
    return dataclasses.field(default=default, metadata={"knob": spec})


def knobs_of(cls: type) -> tuple[Knob, ...]:
    """The knobs of a configuration dataclass, in declaration order."""
    cached = cls.__dict__.get("_knobs_cache")
    if cached is not None:
        return cached
    hints = get_type_hints(cls)
    section = getattr(cls, "KNOB_SECTION", None)
    result = []
    for field in dataclasses.fields(cls):
        spec = field.metadata.get("knob")
        if spec is None:
            continue
        spec = dict(spec)
        where = spec["deployment"]
        if where == _SAME:
            where = f"{section}.{field.name}" if section else None
        elif where is not None and "." not in where:
            where = f"{where}.{field.name}"
        spec["deployment"] = where
        if spec["flag"] == _SAME:
            spec["flag"] = "--" + field.name.replace("_", "-")
        default = None if spec["factory"] is not None else field.default
        result.append(Knob(name=field.name, annotation=hints[field.name], default=default, **spec))
    knobs = tuple(result)
    type.__setattr__(cls, "_knobs_cache", knobs)
    return knobs


def problem(knob: Knob, value: Any) -> str | None:
    """What is wrong with `value` for `knob` ("must be ..., got ..."), or None."""
    if value is None:
        return None if knob.optional else f"must be set, got {value!r}"
    base = knob.base
    if knob.choices:
        if value not in knob.choices:
            return f"must be one of {', '.join(map(str, knob.choices))}, got {value!r}"
        return None
    origin = get_origin(base) or base
    kinds: tuple[type, ...] = (int, float) if base is float else (origin,)
    if (isinstance(value, bool) and base is not bool) or not isinstance(value, kinds):
        noun = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
        return f"must be {noun.get(base, origin.__name__)}, got {value!r}"
    if knob.pattern is not None and not re.fullmatch(knob.pattern, value):
        return f"must be {knob.allowed or 'like ' + knob.pattern}, got {value!r}"
    low_ok = (knob.ge is None or value >= knob.ge) and (knob.gt is None or value > knob.gt)
    if not low_ok or (knob.le is not None and value > knob.le):
        return f"must be {knob.bounds_text}, got {value!r}"
    return None


@dataclass(frozen=True)
class Rule:
    """A check across knobs of one dataclass: `holds(*values)` for the knobs named, else
    `message` formatted with `{0}`, `{1}`, ... as their names and `{v0}`, `{v1}`, ... as their
    values."""

    names: tuple[str, ...]
    holds: Callable[..., bool]
    message: str

    def problem(self, values: Mapping[str, Any], names: Mapping[str, str]) -> str | None:
        """Checked on `values` by knob name, reported with `names` (a knob name -> the name the
        reader knows: "timeouts.heartbeat_s", or a deployment section's bare key)."""
        args = [values[name] for name in self.names]
        if any(arg is None for arg in args) or self.holds(*args):
            return None
        shown = [names.get(name, name) for name in self.names]
        return self.message.format(*shown, **{f"v{i}": arg for i, arg in enumerate(args)})


def check_knobs(config: Any, prefix: str = "") -> None:
    """Raise `ConfigError` for the first knob of `config` (a dataclass instance) out of its type
    or bounds, then for the first of its class's `RULES` that fails."""
    knobs = knobs_of(type(config))
    for each in knobs:
        found = problem(each, getattr(config, each.name))
        if found:
            raise ConfigError(f"{prefix}{each.name} {found}")
    values = {each.name: getattr(config, each.name) for each in knobs}
    names = {each.name: prefix + each.name for each in knobs}
    for rule in getattr(type(config), "RULES", ()):
        found = rule.problem(values, names)
        if found:
            raise ConfigError(found)


def default_text(knob: Knob) -> str:
    """The default as the docs table and the CLI's help show it."""
    if knob.default_value is None or (knob.when_unset and not knob.default_value):
        return knob.when_unset or "unset"
    if isinstance(knob.default_value, bool):
        return "on" if knob.default_value else "off"
    if isinstance(knob.default_value, tuple | dict) and not knob.default_value:
        return "none"
    return (
        f"{knob.default_value:g}"
        if isinstance(knob.default_value, float)
        else str(knob.default_value)
    )


def knob_table(*classes: type) -> str:
    """The Markdown table of every knob of `classes` (docs/engine.md holds it; a test compares)."""
    lines = [
        "| knob | default | deployment | flag | console | live | meaning |",
        "|---|---|---|---|---|---|---|",
    ]
    for cls in classes:
        for each in knobs_of(cls):
            unit = f" {each.unit}" if each.unit and each.default_value is not None else ""
            flag = each.flag or ""
            if each.flag and each.base is bool:
                flag = f"{each.flag}, --no-{each.flag[2:]}"
            elif each.negation:
                flag = f"{each.flag}, {each.negation[0]}"
            cells = [
                f"`{each.name}`",
                default_text(each) + unit,
                f"`{each.deployment}`" if each.deployment else "",
                f"`{flag}`" if flag else "",
                each.label,
                "yes" if each.live else "",
                each.help + (f" ({_range(each)})" if _range(each) else ""),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _range(each: Knob) -> str:
    if each.choices:
        return "one of " + ", ".join(f"`{choice}`" for choice in each.choices)
    if each.pattern is not None:
        return each.allowed
    return each.bounds_text if each.base in (int, float) else ""
