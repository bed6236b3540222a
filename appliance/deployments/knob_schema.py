"""The deployment file's knob sections, derived from the knobs (`dgpp.engine.configuration.knobs`):
each knob whose `deployment` key names a section becomes a strict pydantic field there, with the
knob's type, default, bounds and help; the knobs' cross rules (`Rule`) become the section's
check."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, get_origin

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from dgpp.engine.configuration.knobs import Knob, Rule, knobs_of


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


def section_knobs(section: str, *classes: type) -> list[Knob]:
    """The knobs of `classes` whose deployment key lies in `section`."""
    return [
        each
        for cls in classes
        for each in knobs_of(cls)
        if each.deployment is not None and each.deployment.split(".")[0] == section
    ]


def key_of(each: Knob) -> str:
    """The knob's key within its section."""
    assert each.deployment is not None
    return each.deployment.split(".", 1)[1]


def _field(each: Knob) -> Any:
    constraints: dict[str, Any] = {
        bound: getattr(each, bound)
        for bound in ("ge", "gt", "le")
        if getattr(each, bound) is not None
    }
    if each.pattern is not None:
        constraints["pattern"] = f"^(?:{each.pattern})$"
    if get_origin(each.base) is tuple:
        constraints["strict"] = False  # a YAML or JSON list becomes the knob's tuple
    if each.factory is not None:
        return Field(default_factory=each.factory, description=each.help, **constraints)
    return Field(each.default, description=each.help, **constraints)


def section_model(
    name: str,
    section: str,
    *classes: type,
    base: type[BaseModel] = Section,
    doc: str = "",
) -> type[BaseModel]:
    """A pydantic model of `section`, holding the knobs of `classes` that live there (absent
    ones take the knobs' defaults) and checking those classes' rules among them."""
    knobs = section_knobs(section, *classes)
    fields = {key_of(each): (each.annotation, _field(each)) for each in knobs}
    keys = {each.name: key_of(each) for each in knobs}
    rules = [
        rule
        for cls in classes
        for rule in getattr(cls, "RULES", ())
        if all(name in keys for name in rule.names)
    ]
    validators = {}
    if rules:
        validators["_knob_rules"] = model_validator(mode="after")(_rules_check(rules, keys))
    model = create_model(name, __base__=base, __validators__=validators, **fields)  # type: ignore[call-overload]
    model.__doc__ = doc or f"The `{section}:` section's knobs (see docs/engine.md)."
    return model


def _rules_check(rules: Sequence[Rule], keys: dict[str, str]) -> Any:
    def check(self: BaseModel) -> BaseModel:
        values = {name: getattr(self, key) for name, key in keys.items()}
        for rule in rules:
            found = rule.problem(values, keys)
            if found:
                raise ValueError(found)
        return self

    return check


def knob_values(deployment: BaseModel, cls: type) -> dict[str, Any]:
    """The knobs of `cls` as the deployment sets them (every knob it has a key for), as `cls`'s
    keyword arguments."""
    values = {}
    for each in knobs_of(cls):
        if each.deployment is not None:
            section, key = each.deployment.split(".", 1)
            values[each.name] = getattr(getattr(deployment, section), key)
    return values
