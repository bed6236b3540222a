"""The adaptive draft depth (`engine/speculative/spec_depth.py`): deeper while drafts are accepted,
back to one token when they are not, never past the knob's depth, and shallower (or none) where the
step-time model says a batch is compute-bound."""

from __future__ import annotations

from pathlib import Path

import pytest

from dgpp.engine import LLM
from dgpp.engine.scheduling.step_times import StepTimes
from dgpp.engine.speculative.spec_depth import THRESHOLD, Acceptance, pay_threshold
from tests.conftest import build_tiny_checkpoint
from tests.engine.speculative.mtp_checkpoint import ARCH, MOE, with_mtp_layer


@pytest.fixture(scope="module")
def tiny_mtp(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("mtp")
    path = build_tiny_checkpoint(out, tokenizer_dir, ARCH, num_nextn_predict_layers=1, **MOE)
    with_mtp_layer(path)
    return path


def test_new_requests_start_at_the_depth_the_priors_pay() -> None:
    fresh = Acceptance()
    assert fresh.first * fresh.further >= THRESHOLD > fresh.first * fresh.further**2
    assert fresh.depth(4) == 2 and fresh.depth(1) == 1


def test_accepted_drafts_deepen_and_rejected_ones_shorten() -> None:
    good = Acceptance()
    for _ in range(20):
        good.observe(good.depth(4), good.depth(4))  # every token accepted
    assert good.depth(4) == 4 and good.depth(6) == 6
    bad = Acceptance()
    for _ in range(20):
        bad.observe(bad.depth(4), 0)  # the first token rejected every time
    assert bad.depth(4) == 1
    assert bad.first < 0.01 and bad.further == Acceptance().further  # chained tokens never tried


def test_first_tokens_accepted_chained_ones_not_stay_at_one() -> None:
    """The benchmark's trained layer: its own next token right, its chained guesses rarely."""
    mixed = Acceptance()
    for _ in range(20):
        mixed.observe(4, 1)
    assert mixed.first > 0.99 and mixed.further < 0.01
    assert mixed.depth(4) == 1
    mixed.observe(0, 0)  # a row without a draft changes nothing
    assert mixed.depth(4) == 1


def _times(decode_step_s: float, token_s: float) -> StepTimes:
    times = StepTimes()
    times.observe(decode_step_s, 4, [])  # a decode-only step
    for start in (0, 256, 512):  # prompt steps: `token_s` a token, at every position and size
        for tokens in (16, 64):
            times.observe(decode_step_s + tokens * token_s, 0, [(start, tokens)])
    return times


def test_a_compute_bound_batch_drafts_less() -> None:
    """A draft token costs a prompt token's share of the verify forward; in a batch of R
    rows a token the plain way costs decode_step_s / R. 10 ms steps, 0.5 ms tokens: one row
    keeps the bar at THRESHOLD, 16 rows raise it to 0.8, 40 rows (2.0) stop drafting."""
    times = _times(0.010, 0.0005)
    assert times.token_cost()[0] == pytest.approx(0.0005) and times.token_cost()[1] < 1e-9
    assert pay_threshold(times, 1, 300) == THRESHOLD
    assert pay_threshold(times, 16, 300) == pytest.approx(0.8)
    assert pay_threshold(times, 40, 300) == pytest.approx(2.0)
    assert pay_threshold(None, 40, 300) == pay_threshold(StepTimes(), 40, 300) == THRESHOLD
    good = Acceptance(first=0.95, further=0.85)
    assert good.depth(4) == 4  # 0.95 * 0.85^3 = 0.58 >= 0.5
    assert good.depth(4, pay_threshold(times, 16, 300)) == 2  # 0.81 >= 0.8 > 0.69
    assert good.depth(4, pay_threshold(times, 40, 300)) == 0  # not even the first token


def test_the_drafter_prices_drafts_by_the_schedulers_step_times(tiny_mtp: Path) -> None:
    llm = LLM(str(tiny_mtp), speculative="mtp", kv_capacity=256, block_size=8)
    assert llm.engine.drafter is not None
    assert llm.engine.drafter.times is llm.engine.scheduler.times
