"""Counting a quantized MoE's weights with one module in every slot of experts stored alike
(`moe_blocks.COUNTING_ONLY`, what `weight_count.count_weights` sets) gives the bytes of the
model built expert by expert, also where one expert is stored otherwise (then it is built
expert by expert); it builds one expert module per layer instead of hundreds."""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import replace

import pytest

from dgpp.appliance.models.facts import UniformSchemes, facts_config
from dgpp.engine.layers.moe import PackedExperts
from dgpp.engine.planning import weight_count


def _both(monkeypatch: pytest.MonkeyPatch, model: object, tp: int) -> tuple[object, object]:
    shared = weight_count.count_weights(model, tp, 0)
    with monkeypatch.context() as patch:  # the variable packed_experts reads never set
        patch.setattr(weight_count, "COUNTING_ONLY", ContextVar("off", default=False))
        built = weight_count.count_weights(model, tp, 0)
    return shared, built


@pytest.mark.parametrize("tp", [1, 2])
def test_shared_expert_slots_count_as_every_expert_built(
    monkeypatch: pytest.MonkeyPatch, tp: int
) -> None:
    model = facts_config("Qwen/Qwen3-30B-A3B-FP8")
    model = replace(model, num_layers=3)
    shared, built = _both(monkeypatch, model, tp)
    assert shared == built and shared[1] > 0  # packed bytes: the FP8 experts


def test_an_expert_stored_otherwise_is_counted_as_stored(monkeypatch: pytest.MonkeyPatch) -> None:
    model = replace(facts_config("Qwen/Qwen3-30B-A3B-FP8"), num_layers=2)
    schemes = model.quant_schemes
    assert isinstance(schemes, UniformSchemes)
    dense = frozenset({*schemes.unquantized, "model.layers.1.mlp.experts.3.down_proj"})
    mixed = replace(model, quant_schemes=replace(schemes, unquantized=dense))
    shared, built = _both(monkeypatch, mixed, 1)
    assert shared == built
    assert shared != _both(monkeypatch, model, 1)[0]  # that expert's down_proj is dense now


def test_the_shared_slots_are_one_module(monkeypatch: pytest.MonkeyPatch) -> None:
    from dgpp.engine.models import moe_blocks

    seen: list[PackedExperts] = []
    original = PackedExperts.__init__

    def spy(self: PackedExperts, modules: object) -> None:
        original(self, modules)
        seen.append(self)

    monkeypatch.setattr(PackedExperts, "__init__", spy)
    weight_count.count_weights(replace(facts_config("Qwen/Qwen3-30B-A3B-FP8"), num_layers=2), 1, 0)
    assert seen and all(len({id(e) for e in experts}) == 1 for experts in seen)
    assert moe_blocks.COUNTING_ONLY.get() is False  # reset after counting
