"""The knobs form, generated from the deployment schema: each knob's input kind, bounds, choices
and default come from the pydantic field; the values posted are converted and validated on the
server, and every problem is reported against the field it belongs to."""

from __future__ import annotations

import copy
import json
import types
from dataclasses import dataclass
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from dgpp.appliance.deployments.deployment import Deployment, parse_deployment
from dgpp.appliance.deployments.files import expand_template
from dgpp.engine.configuration.engine_config import EngineConfig
from dgpp.engine.configuration.knobs import GROUPS, Knob, knobs_of
from dgpp.engine.distributed.world_spec import WorldTimeouts
from dgpp.engine.server.core.config import ServerConfig

# The console's knobs: every knob with a label (dgpp.engine.configuration.knobs), as (key path,
# label, help), in declaration order: the engine's, then the server's, then the runtime's deadlines.
# A live knob says so: a change of live knobs alone is applied without a restart (the switch
# reloads).
LIVE_NOTE = " (applied live, no restart)"
KNOBS: tuple[Knob, ...] = tuple(
    each
    for cls in (EngineConfig, ServerConfig, WorldTimeouts)
    for each in knobs_of(cls)
    if each.label and each.deployment is not None
)

Kind = Literal["int", "float", "bool", "choice", "names", "json", "text"]


@dataclass(frozen=True)
class KnobField:
    path: str
    label: str
    help: str
    kind: Kind
    optional: bool  # an empty input means null
    default: Any
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False
    group: str = ""  # the form's section (`dgpp.engine.configuration.knobs.GROUPS`)
    advanced: bool = False  # folded under the section's "advanced"

    @property
    def name(self) -> str:  # the form input's name
        return self.path

    def text(self, value: Any) -> str:
        """How a value shows in the input."""
        if value is None:
            return ""
        if self.kind == "bool":
            return "on" if value else "off"
        if self.kind == "names":
            return ", ".join(value)
        if self.kind == "json":
            return json.dumps(value)
        return str(value)


def _field_info(path: str) -> FieldInfo:
    section, name = path.split(".")
    section_model = Deployment.model_fields[section].annotation
    assert isinstance(section_model, type) and issubclass(section_model, BaseModel)
    return section_model.model_fields[name]


def _kind(annotation: Any) -> tuple[Kind, bool, tuple[str, ...]]:
    args = get_args(annotation)
    optional = get_origin(annotation) in (Union, types.UnionType) and type(None) in args
    if optional:
        annotation = next(arg for arg in args if arg is not type(None))
    origin = get_origin(annotation)
    if origin is Literal:
        return "choice", optional, tuple(str(arg) for arg in get_args(annotation))
    if annotation is bool:
        return "bool", optional, ("on", "off")
    if annotation is int:
        return "int", optional, ()
    if annotation is float:
        return "float", optional, ()
    if annotation is str:
        return "text", optional, ()
    if origin in (list, tuple):
        return "names", optional, ()
    if origin is dict:
        return "json", optional, ()
    raise AssertionError(f"no form input for {annotation!r}")


def knob_fields() -> list[KnobField]:
    fields = []
    for each in KNOBS:
        path = each.deployment
        assert path is not None
        help_text = each.help + (LIVE_NOTE if each.live else "")
        info = _field_info(path)
        kind, optional, choices = _kind(info.annotation)
        bounds: dict[str, Any] = {}
        for item in info.metadata:
            if isinstance(item, annotated_types.Ge):
                bounds["minimum"] = item.ge
            elif isinstance(item, annotated_types.Gt):
                bounds.update(minimum=item.gt, exclusive_minimum=True)
            elif isinstance(item, annotated_types.Le):
                bounds["maximum"] = item.le
        default = info.get_default(call_default_factory=True)
        fields.append(
            KnobField(
                path,
                each.label,
                help_text,
                kind,
                optional,
                default,
                choices,
                **bounds,
                group=each.group,
                advanced=each.advanced,
            )
        )
    return fields


@dataclass(frozen=True)
class Section:
    """One section of the form: the knobs of a group, the common ones first, the rest folded."""

    id: str
    title: str
    common: tuple[KnobField, ...]
    advanced: tuple[KnobField, ...]


def sections(fields: list[KnobField]) -> list[Section]:
    """The form's sections in `GROUPS` order, each field in its declaration order."""
    return [
        Section(
            group,
            title,
            tuple(f for f in fields if f.group == group and not f.advanced),
            tuple(f for f in fields if f.group == group and f.advanced),
        )
        for group, title in GROUPS.items()
        if any(f.group == group for f in fields)
    ]


def current_values(deployment: Deployment) -> dict[str, Any]:
    dumped = deployment.model_dump(mode="json")
    return {field.path: _get(dumped, field.path) for field in knob_fields()}


def _get(data: dict[str, Any], path: str) -> Any:
    for key in path.split("."):
        data = data[key]
    return data


def set_path(raw: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A copy of `raw` with `path` set to `value` (a whole object replaces, never merges)."""
    result = copy.deepcopy(raw)
    target = result
    keys = path.split(".")
    for key in keys[:-1]:
        if not isinstance(target.get(key), dict):
            target[key] = {}
        target = target[key]
    target[keys[-1]] = value
    return result


def _convert(field: KnobField, text: str) -> Any:
    """The posted text as the field's type; ValueError with a message for the operator."""
    text = text.strip()
    if text == "" and field.optional:
        return None
    if field.kind == "int":
        try:
            return int(text)
        except ValueError:
            raise ValueError("must be a whole number") from None
    if field.kind == "float":
        try:
            return float(text)
        except ValueError:
            raise ValueError("must be a number") from None
    if field.kind == "bool":
        if text not in ("on", "off"):
            raise ValueError("must be on or off")
        return text == "on"
    if field.kind == "choice":
        if text not in field.choices:
            raise ValueError(f"must be one of {', '.join(field.choices)}")
        return text
    if field.kind == "names":
        return [name.strip() for name in text.split(",") if name.strip()]
    if field.kind == "text":
        return text
    try:
        value = json.loads(text or "{}")
    except json.JSONDecodeError as err:
        raise ValueError(f"not valid JSON: {err.msg}") from None
    if not isinstance(value, dict):
        raise ValueError("must be a JSON object")
    return value


@dataclass(frozen=True)
class KnobResult:
    raw: dict[str, Any]  # the new deployment file content (the old one when there are errors)
    values: dict[str, str]  # what the operator typed, to show the form again
    errors: dict[str, str]  # field path -> problem; "" for problems of no one field
    # The new deployment with every refused knob left at its current value, which passes every
    # check (None when none does): the memory plan is drawn for it, so its verdict comes in the
    # same pass as the fields' errors.
    checked: Deployment | None = None


def apply_form(form: dict[str, str], raw: dict[str, Any], current: Deployment) -> KnobResult:
    """The posted form applied to the file `raw`. Only knobs whose value differs from the
    effective deployment are written, so the file keeps its shape (and its template).

    Every problem comes back at once: a knob that does not convert keeps its current value
    while the others are validated, and a knob the schema or the engine's checks refuse is put
    back while the rest are checked again, so no mistake hides another."""
    fields = knob_fields()
    effective = current_values(current)
    typed = {
        field.path: form.get(field.path, field.text(effective[field.path])) for field in fields
    }
    errors: dict[str, str] = {}
    new_raw = copy.deepcopy(raw)
    for field in fields:
        try:
            value = _convert(field, typed[field.path])
        except ValueError as err:
            errors[field.path] = str(err)
            continue
        if value != effective[field.path]:
            new_raw = set_path(new_raw, field.path, value)
    found, checked = _check_all(new_raw, raw)
    for path, message in found.items():
        errors.setdefault(path, message)
    return KnobResult(raw if errors else new_raw, typed, errors, checked)


def _check_all(
    new_raw: dict[str, Any], raw: dict[str, Any]
) -> tuple[dict[str, str], Deployment | None]:
    """`validation_errors` of `new_raw`, again and again with each refused knob restored to
    its value in `raw`, until the rest passes (then also that deployment) or what is refused
    is no knob the form changed."""
    errors: dict[str, str] = {}
    candidate = new_raw
    paths = {each.deployment for each in KNOBS}
    while True:
        found = validation_errors(candidate)
        if not found:
            return errors, parse_deployment(expand_template(candidate))
        for path, message in found.items():
            errors.setdefault(path, message)
        restorable = [
            path
            for path in found
            if path in paths and _lookup(candidate, path) != _lookup(raw, path)
        ]
        if not restorable:
            return errors, None
        for path in restorable:
            candidate = _restore(candidate, raw, path)


_MISSING = object()


def _lookup(data: dict[str, Any], path: str) -> Any:
    for key in path.split("."):
        if not isinstance(data, dict) or key not in data:
            return _MISSING
        data = data[key]
    return data


def _restore(raw: dict[str, Any], original: dict[str, Any], path: str) -> dict[str, Any]:
    """A copy of `raw` whose `path` is as in `original` (absent when it is absent there)."""
    value = _lookup(original, path)
    if value is not _MISSING:
        return set_path(raw, path, copy.deepcopy(value))
    result = copy.deepcopy(raw)
    section, key = path.split(".")
    if isinstance(result.get(section), dict):
        result[section].pop(key, None)
    return result


def validation_errors(raw: dict[str, Any]) -> dict[str, str]:
    """What the schema, and the engine's and runtime's own checks, refuse in `raw`, by key path
    (`""` for what belongs to no one knob); `{}` when rank 0 would accept it."""
    from dgpp.appliance.deployments.deployment import engine_config, pattern_detail, world_timeouts
    from dgpp.engine.errors import ConfigError

    try:
        deployment = Deployment.model_validate(expand_template(raw))
    except ConfigError as err:
        return {"": err.message}
    except ValidationError as err:
        errors: dict[str, str] = {}
        for error in err.errors():
            path = ".".join(str(part) for part in error["loc"][:2])
            message = error["msg"]
            if error["type"] == "literal_error":
                message = f"must be one of {error['ctx']['expected']}"
            elif error["type"] == "string_pattern_mismatch":
                message = pattern_detail(path, message)
            elif error["type"] == "extra_forbidden":
                message = "unknown key"
            elif error["type"] == "value_error":  # a section's own rule across its keys
                message = message.removeprefix("Value error, ")
                if len(error["loc"]) == 1:
                    path = _owner(message, section=path) or path
            errors.setdefault(path, message)
        return errors
    try:
        engine_config(deployment)
        world_timeouts(deployment)
    except ConfigError as err:
        return {_owner(err.message): err.message}
    return {}


def _owner(message: str, section: str | None = None) -> str:
    """The knob a check's message is about (it starts with the key's name), or "". With
    `section`, only that section's knobs (its model validator names its keys bare)."""
    first = message.split(" ", 1)[0].rstrip(":")
    for path in (each.deployment or "" for each in KNOBS):
        if section is not None and not path.startswith(f"{section}."):
            continue
        if first in (path, path.split(".")[1]):
            return path
    return ""
