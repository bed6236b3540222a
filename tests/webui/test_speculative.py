"""Speculative decoding in the console: its knobs generated from the deployment's `speculative`
section (the section's own rule reported on its field), the overview saying whether it is on,
and the acceptance chart's samples from a `/v1/metrics` body of the engine's own shape."""

from __future__ import annotations

import json
import re

import pytest

from dgpp.appliance.deployments.deployment import parse_deployment
from dgpp.engine.scheduling.stats import EngineCounters, EngineStats, SpecCounters
from dgpp.engine.server.metrics.service import ServiceCounters
from dgpp.engine.server.routes.metrics_routes import metrics_body
from dgpp.webui.deployments.knob_form import knob_fields, validation_errors
from dgpp.webui.monitor.metrics_poller import sample_of
from dgpp.webui.routes.overview_routes import speculative_view
from tests.webui.conftest import DEPLOYMENT, Console, hidden


def _errors(html: str) -> dict[str, str]:
    return dict(re.findall(r'id="error-([^"]+)">([^<]+)<', html))


def test_the_speculative_knobs_follow_the_schema() -> None:
    fields = {field.path: field for field in knob_fields()}
    method = fields["speculative.method"]
    choices = ("off", "ngram", "mtp")
    assert (method.kind, method.choices, method.default) == ("choice", choices, "off")
    assert method.label == "Speculative decoding"
    depth = fields["speculative.depth"]
    assert (depth.kind, depth.minimum, depth.maximum, depth.default) == ("int", 1, 16, 4)
    assert (fields["speculative.ngram_max"].default, fields["speculative.ngram_min"].default) == (
        4,
        2,
    )
    adaptive = fields["speculative.adaptive"]
    assert (adaptive.kind, adaptive.default, adaptive.label) == ("bool", True, "Adaptive depth")


def test_the_sections_own_rule_names_its_field() -> None:
    raw = {"model": "default", "speculative": {"ngram_min": 5, "ngram_max": 3}}
    assert validation_errors(raw) == {
        "speculative.ngram_min": "ngram_min (5) must not exceed ngram_max (3)"
    }


def test_an_ngram_range_upside_down_is_refused_on_its_field(logged_in: Console) -> None:
    before = logged_in.config.deployment.read_text()
    response = logged_in.preview_knobs(
        {
            "speculative.method": "ngram",
            "speculative.ngram_max": "3",
            "speculative.ngram_min": "5",
        }
    )
    assert response.status_code == 400
    assert _errors(response.text) == {
        "speculative.ngram_min": "ngram_min (5) must not exceed ngram_max (3)"
    }
    assert "Nothing was applied" in response.text
    # Out of bounds, or not a choice: the schema's message, on the field.
    response = logged_in.preview_knobs(
        {
            "speculative.method": "eagle",
            "speculative.depth": "17",
        }
    )
    assert response.status_code == 400
    assert _errors(response.text) == {  # both at once
        "speculative.method": "must be one of off, ngram, mtp",
        "speculative.depth": "Input should be less than or equal to 16",
    }
    response = logged_in.preview_knobs({"speculative.depth": "17"})
    assert _errors(response.text) == {
        "speculative.depth": "Input should be less than or equal to 16"
    }
    assert logged_in.world.actions == []
    assert logged_in.config.deployment.read_text() == before


def test_a_rule_about_a_key_not_on_the_form_is_shown_on_top(
    logged_in: Console, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dgpp.webui.deployments import knob_form

    without_min = tuple(
        knob for knob in knob_form.KNOBS if knob.deployment != "speculative.ngram_min"
    )
    monkeypatch.setattr(knob_form, "KNOBS", without_min)
    response = logged_in.preview_knobs({"speculative.ngram_max": "1"})
    assert response.status_code == 400
    assert _errors(response.text) == {}
    message = "speculative: ngram_min (2) must not exceed ngram_max (1)"
    assert f'id="knob-error" role="alert">{message}<' in response.text
    assert logged_in.world.actions == []


def test_turning_ngram_on_writes_the_section_and_the_overview_says_so(
    logged_in: Console,
) -> None:
    page = logged_in.client.get("/").text
    assert '<td id="spec-state" data-field="speculative.text" data-empty="-">off</td>' in page
    assert 'data-empty="speculative decoding is off"' in page
    preview = logged_in.preview_knobs(
        {
            "speculative.method": "ngram",
            "speculative.depth": "6",
            "speculative.ngram_min": "2",  # the default: not written
        }
    )
    assert preview.status_code == 200, preview.text
    rows = re.findall(r'<td class="key">([^<]+)</td>', preview.text)
    assert rows == ["speculative.depth", "speculative.method"]
    deployment = json.loads(hidden(preview.text, "deployment").replace("&#34;", '"'))
    assert deployment == {**DEPLOYMENT, "speculative": {"method": "ngram", "depth": 6}}
    logged_in.apply(deployment, "Apply knobs")
    assert logged_in.wait_for_switch()["phase"] == "ready"
    assert logged_in.world.actions == ["drain", "restart"]
    assert logged_in.written()["speculative"] == {"method": "ngram", "depth": 6}
    body = logged_in.client.get("/api/overview").json()
    assert body["speculative"] == {
        "method": "ngram",
        "depth": 6,
        "source": "engine",
        "text": "ngram, depth 6",
        "empty": "ngram, depth 6: nothing drafted in this window",
    }
    page = logged_in.client.get("/").text
    assert 'data-field="speculative.text" data-empty="-">ngram, depth 6</td>' in page
    assert "no speculative decoding" not in page
    # The form now shows what the deployment runs.
    knobs = logged_in.client.get("/knobs").text
    assert '<option value="ngram" selected>' in knobs
    assert 'id="speculative.depth" name="speculative.depth" type="text" value="6"' in knobs


def test_without_the_engine_the_overview_shows_the_configured_method() -> None:
    deployment = parse_deployment({"model": "default", "speculative": {"method": "ngram"}})
    view = speculative_view(None, deployment)
    assert (view["source"], view["text"]) == (
        "deployment",
        "ngram, depth 4 (configured; the engine does not say)",
    )
    # An engine's own word wins over the file (dgpp serve --no-spec, say).
    off = {"spec_decode": {"method": "off", "depth": 0, "drafted": 0, "accepted": 0}}
    assert speculative_view(off, deployment)["text"] == "off"


def _engine_metrics(tokens: int, spec: SpecCounters, method: str = "ngram") -> dict:
    """A `/v1/metrics` body as the engine's server builds it."""
    counters = EngineCounters(tokens_generated=tokens, prompt_tokens_total=50, spec_decode=spec)
    stats = EngineStats(1, 0, 0, 64, 4, 16, True, 1024, counters, method, 4)
    return metrics_body(stats, ServiceCounters())


def test_acceptance_between_two_samples_of_the_engines_metrics() -> None:
    spec = SpecCounters()
    first, snapshot = sample_of(10.0, _engine_metrics(0, spec), True, None)
    assert first.spec_acceptance is None  # one snapshot: nothing to compare with
    # Nothing drafted between two samples: no acceptance (not 0 %).
    second, snapshot = sample_of(11.0, _engine_metrics(5, spec), True, snapshot)
    assert second.spec_acceptance is None and second.gen_tps == pytest.approx(5.0)
    spec.record(4, 3)
    spec.record(4, 1)
    body = _engine_metrics(12, spec)
    assert body["spec_decode"]["acceptance_rate"] == pytest.approx(0.5)
    third, snapshot = sample_of(12.0, body, True, snapshot)
    assert third.spec_acceptance == pytest.approx(0.5)
    spec.record(4, 4)
    fourth, snapshot = sample_of(13.0, _engine_metrics(20, spec), True, snapshot)
    assert fourth.spec_acceptance == pytest.approx(1.0)  # this interval only, not cumulative
    # The engine restarted (counters went down): that interval has no acceptance.
    fifth, _ = sample_of(14.0, _engine_metrics(0, SpecCounters()), True, snapshot)
    assert fifth.spec_acceptance is None
