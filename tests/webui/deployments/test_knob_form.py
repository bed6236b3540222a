"""The knobs form is generated from the deployment schema and validated on the server."""

from __future__ import annotations

from dgpp.appliance.deployments.deployment import parse_deployment
from dgpp.webui.deployments.knob_form import apply_form, knob_fields, set_path, validation_errors


def test_fields_follow_the_schema() -> None:
    fields = {field.path: field for field in knob_fields()}
    kv = fields["engine.kv_capacity"]
    assert (kv.kind, kv.default, kv.minimum, kv.optional) == ("int", 16384, 1, False)
    assert fields["engine.max_model_len"].optional
    assert fields["engine.prefill_precision"].choices == ("fp32", "model")
    assert fields["engine.prefix_cache"].kind == "bool"
    snapshots = fields["engine.prefix_cache_gib"]
    assert (snapshots.kind, snapshots.default, snapshots.minimum) == ("float", 4.0, 0)
    assert not snapshots.exclusive_minimum and "recurrent-state snapshots" in snapshots.help
    assert fields["http.served_model_names"].kind == "names"
    assert fields["http.default_chat_template_kwargs"].kind == "json"
    heartbeat = fields["timeouts.heartbeat_s"]
    assert (heartbeat.kind, heartbeat.minimum, heartbeat.exclusive_minimum) == ("float", 0, True)


def test_only_changed_knobs_are_written_and_objects_replace() -> None:
    raw = {
        "template": "smollm2-135m_float32_w1",
        "http": {"default_chat_template_kwargs": {"a": 1, "b": 2}},
    }
    current = parse_deployment(
        {"model": "default", "http": {"default_chat_template_kwargs": {"a": 1, "b": 2}}}
    )
    result = apply_form(
        {
            "engine.max_model_len": "",
            "http.default_chat_template_kwargs": '{"a": 1}',
            "engine.kv_capacity": "16384",  # the default, unchanged: not written
        },
        raw,
        current,
    )
    assert result.errors == {}
    assert result.raw == {
        "template": "smollm2-135m_float32_w1",
        "http": {"default_chat_template_kwargs": {"a": 1}},
    }


def test_errors_name_their_field() -> None:
    current = parse_deployment({"model": "default"})
    result = apply_form({"engine.prefix_cache": "maybe"}, {"model": "default"}, current)
    assert result.errors == {"engine.prefix_cache": "must be on or off"}
    result = apply_form({"http.queue_limit": "-1"}, {"model": "default"}, current)
    assert result.errors == {"http.queue_limit": "Input should be greater than or equal to 0"}
    assert result.raw == {"model": "default"}  # nothing of a refused form is kept
    assert validation_errors({"model": "default", "bogus": 1}) == {"bogus": "unknown key"}
    assert "no template named" in validation_errors({"template": "nope"})[""]


def test_the_snapshot_budget_is_converted_and_validated() -> None:
    current = parse_deployment({"model": "default"})
    result = apply_form({"engine.prefix_cache_gib": "1.5"}, {"model": "default"}, current)
    assert result.errors == {}
    assert result.raw == {"model": "default", "engine": {"prefix_cache_gib": 1.5}}
    unchanged = apply_form({"engine.prefix_cache_gib": "4"}, {"model": "default"}, current)
    assert unchanged.raw == {"model": "default"}  # the default: not written
    errors = apply_form({"engine.prefix_cache_gib": "lots"}, {"model": "default"}, current).errors
    assert errors == {"engine.prefix_cache_gib": "must be a number"}
    errors = apply_form({"engine.prefix_cache_gib": "-1"}, {"model": "default"}, current).errors
    assert errors == {"engine.prefix_cache_gib": "Input should be greater than or equal to 0"}
    # The knob's bound beyond any machine (declared once, so the schema's too).
    errors = apply_form({"engine.prefix_cache_gib": "1e9"}, {"model": "default"}, current).errors
    assert errors == {"engine.prefix_cache_gib": "Input should be less than or equal to 1048576"}


def test_every_mistake_is_reported_in_one_pass() -> None:
    """A value that does not convert, one the schema refuses and one the runtime's own check
    refuses come back together, each on its field; the deployment checked beside them keeps
    the refused knobs at their current values and the valid change."""
    raw = {"model": "default", "timeouts": {"control_deadline_s": 120.0}}
    current = parse_deployment(raw)
    result = apply_form(
        {
            "engine.kv_capacity": "lots",  # conversion
            "http.queue_limit": "-1",  # schema
            "timeouts.heartbeat_s": "100",  # the runtime's rule across two timeouts
            "engine.max_concurrency": "8",  # valid
        },
        raw,
        current,
    )
    assert result.errors == {
        "engine.kv_capacity": "must be a whole number",
        "http.queue_limit": "Input should be greater than or equal to 0",
        "timeouts.heartbeat_s": (
            "heartbeat_s (100.0) must be at most half of "
            "control_deadline_s (120.0), or idle workers would declare a healthy head lost"
        ),
    }
    assert result.raw == raw  # nothing of a refused form is kept
    checked = result.checked
    assert checked is not None
    assert (checked.engine.kv_capacity, checked.http.queue_limit) == (16384, 256)
    assert checked.timeouts.heartbeat_s == 1.0
    assert checked.engine.max_concurrency == 8


def test_a_valid_form_is_checked_as_written() -> None:
    current = parse_deployment({"model": "default"})
    result = apply_form({"engine.kv_capacity": "4096"}, {"model": "default"}, current)
    assert result.errors == {}
    assert result.checked is not None and result.checked.engine.kv_capacity == 4096
    # What names no knob cannot be put back: nothing is checked beside it.
    assert apply_form({}, {"template": "nope"}, current).checked is None


def test_set_path_copies() -> None:
    raw = {"engine": {"kv_capacity": 1}}
    assert set_path(raw, "engine.block_size", 32) == {
        "engine": {"kv_capacity": 1, "block_size": 32}
    }
    assert raw == {"engine": {"kv_capacity": 1}}


def test_sections_hold_every_knob_once_in_group_order_common_first() -> None:
    from dgpp.engine.configuration.knobs import GROUPS
    from dgpp.webui.deployments.knob_form import sections

    fields = knob_fields()
    found = sections(fields)
    assert [section.id for section in found] == list(GROUPS)  # every group has knobs
    listed = [f.path for s in found for f in (*s.common, *s.advanced)]
    assert sorted(listed) == sorted(f.path for f in fields) and len(set(listed)) == len(listed)
    for section in found:
        assert section.common, f"{section.title} shows nothing until unfolded"
        assert all(f.group == section.id and not f.advanced for f in section.common)
        assert all(f.group == section.id and f.advanced for f in section.advanced)
    by_path = {f.path: f for f in fields}
    assert (
        by_path["engine.kv_capacity"].group == "memory"
        and not by_path["engine.kv_capacity"].advanced
    )
    assert (
        by_path["timeouts.heartbeat_s"].advanced
        and by_path["speculative.method"].group == "speculative"
    )


def test_a_console_knob_without_a_group_is_refused_where_it_is_declared() -> None:
    import pytest

    from dgpp.engine.configuration.knobs import knob

    with pytest.raises(ValueError, match="needs a group"):
        knob(1, "a knob", label="Shown")
    with pytest.raises(ValueError, match="needs a group"):
        knob(1, "a knob", label="Shown", group="elsewhere")
    knob(1, "a knob off the console")  # no label: no group needed
