"""The adaptive draft depth (`engine/spec_depth.py`): deeper while drafts are accepted, back to
one token when they are not, never past the knob's depth."""

from __future__ import annotations

from dgpp.engine.spec_depth import THRESHOLD, Acceptance


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
