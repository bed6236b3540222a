"""Sampler: filters, penalties, seeding, logprobs and padded vocab, all on CPU."""

from __future__ import annotations

import math

import pytest
import torch

from dgpp.engine.sampling.sampler import (
    NUCLEUS_CANDIDATES,
    Sampler,
    SamplerRow,
    apply_penalties,
    process_logits,
)
from dgpp.engine.sampling.sampling_params import SamplingParams


def row(
    prompt: tuple[int, ...] = (),
    output: tuple[int, ...] = (),
    generator: torch.Generator | None = None,
    **params: object,
) -> SamplerRow:
    return SamplerRow(
        params=SamplingParams(**params),  # type: ignore[arg-type]
        prompt_token_ids=prompt,
        output_token_ids=output,
        generator=generator,
    )


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def sample_many(logits: torch.Tensor, n: int, seed: int = 0, **params: object) -> list[int]:
    """Draw `n` tokens from the same 1-D logits as one batch of n identical rows."""
    sampler = Sampler(logits.shape[0])
    batch = logits.unsqueeze(0).expand(n, -1).contiguous()  # [n, V]
    rows = [row(**params) for _ in range(n)]
    return sampler(batch, rows, default_generator=seeded(seed)).token_ids


def test_seeded_row_is_reproducible_across_batch_composition():
    vocab = 64
    torch.manual_seed(0)
    steps = [torch.randn(vocab) for _ in range(20)]
    sampler = Sampler(vocab)

    def run(position: int, batch: int, neighbour_params: dict[str, object]) -> list[int]:
        generator = seeded(1234)
        default = seeded(99 + batch)
        tokens = []
        for step_logits in steps:
            rows = [row(**neighbour_params) for _ in range(batch)]
            rows[position] = row(generator=generator, temperature=1.0, top_p=0.9)
            # Neighbours get different logits each run so only the seeded row's own inputs match.
            logits = torch.randn(batch, vocab, generator=default)
            logits[position] = step_logits
            tokens.append(sampler(logits, rows, default_generator=default).token_ids[position])
        return tokens

    alone = run(0, 1, {})
    first = run(0, 4, {"temperature": 0.5, "top_k": 3})
    last = run(5, 6, {"seed": 7, "temperature": 0.0})
    assert alone == first == last
    # The seeded row really sampled (a greedy pick would be reproducible for free).
    assert alone != [int(s.argmax()) for s in steps]


def test_different_seeds_give_different_tokens():
    vocab = 32
    logits = torch.zeros(vocab)  # uniform: any sharing of randomness would show up as equality
    sampler = Sampler(vocab)

    def draws(seed: int) -> list[int]:
        generator = seeded(seed)
        out = []
        for _ in range(50):
            rows = [row(generator=generator)]
            out.append(sampler(logits.unsqueeze(0), rows).token_ids[0])
        return out

    assert draws(1) == draws(1)
    assert draws(1) != draws(2)


def test_unseeded_rows_use_default_generator():
    logits = torch.zeros(4, 16)
    rows = [row() for _ in range(4)]
    sampler = Sampler(16)
    a = sampler(logits, rows, default_generator=seeded(5)).token_ids
    b = sampler(logits, rows, default_generator=seeded(5)).token_ids
    assert a == b


def test_greedy_picks_argmax_and_leaves_generator_untouched():
    torch.manual_seed(1)
    logits = torch.randn(3, 50)
    generator = seeded(42)
    state = generator.get_state()
    rows = [row(temperature=0.0, generator=generator) for _ in range(3)]
    out = Sampler(50)(logits, rows)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert torch.equal(generator.get_state(), state)


def test_mixed_greedy_and_sampled_rows():
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 5.0, 1.0]])
    rows = [row(temperature=0.0), row(top_k=1, logit_bias={2: 10.0})]
    assert Sampler(3)(logits, rows, default_generator=seeded(0)).token_ids == [1, 2]


@pytest.mark.parametrize("temperature", [0.0, 1.0, 2.0])
def test_logit_bias_forces_token(temperature: float):
    logits = torch.tensor([3.0, 2.0, 1.0, -1.0])
    tokens = sample_many(logits, 500, temperature=temperature, logit_bias={3: 100.0})
    assert set(tokens) == {3}


def test_negative_logit_bias_bans_token():
    logits = torch.tensor([5.0, 0.0, 0.0])
    tokens = sample_many(logits, 500, logit_bias={0: -100.0})
    assert 0 not in tokens


def test_top_k_only_yields_top_k_tokens():
    logits = torch.tensor([0.1, 2.0, -1.0, 1.5, 1.9, 0.0, 0.3, 1.0])
    tokens = sample_many(logits, 3000, top_k=3)
    assert set(tokens) == {1, 3, 4}
    for disabled in (0, -1, 8, 50):
        out = process_logits(logits.unsqueeze(0), [row(top_k=disabled)], vocab_size=8)
        assert torch.isfinite(out).all()


def test_top_p_keeps_smallest_prefix_reaching_top_p():
    probs = torch.tensor([0.1, 0.5, 0.15, 0.25])
    logits = probs.log().unsqueeze(0)
    # Sorted: 0.5 (id 1), 0.25 (id 3), 0.15 (id 2), 0.1 (id 0); cumulative 0.5, 0.75, 0.9, 1.0.
    out = process_logits(logits, [row(top_p=0.7)], vocab_size=4)[0]
    assert torch.isfinite(out).tolist() == [False, True, False, True]
    # The kept tokens renormalise to 0.5/0.75 and 0.25/0.75.
    torch.testing.assert_close(out.softmax(-1), torch.tensor([0.0, 2 / 3, 0.0, 1 / 3]))

    out = process_logits(logits, [row(top_p=0.8)], vocab_size=4)[0]
    assert torch.isfinite(out).tolist() == [False, True, True, True]

    # A tiny top_p still keeps the top token.
    out = process_logits(logits, [row(top_p=0.01)], vocab_size=4)[0]
    assert torch.isfinite(out).tolist() == [False, True, False, False]

    tokens = sample_many(probs.log(), 2000, top_p=0.7)
    assert set(tokens) == {1, 3}


def test_top_p_one_keeps_tiny_tail():
    # The neighbour makes the top_p stage run; the top_p == 1 row must keep even 1e-39 tails.
    logits = torch.tensor([[30.0, 0.0, -30.0, -60.0]]).expand(2, 4)
    out = process_logits(logits, [row(top_p=1.0), row(top_p=0.5)], vocab_size=4)
    assert torch.isfinite(out[0]).all()
    assert torch.isfinite(out[1]).tolist() == [True, False, False, False]


def test_top_k_then_top_p_renormalises_over_top_k():
    # Probs 0.4, 0.3, 0.2, 0.1. With top_k=3 they renormalise to 4/9, 3/9, 2/9, so the mass
    # before id 2 is 7/9 >= 0.72 and only ids 0 and 1 survive; without top_k that mass is
    # 0.7 < 0.72 and id 2 survives too.
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log().expand(3, 4)
    rows = [row(top_k=3, top_p=0.72), row(top_p=0.72), row(top_k=2)]
    out = process_logits(logits, rows, vocab_size=4)
    assert torch.isfinite(out).tolist() == [
        [True, True, False, False],
        [True, True, True, False],
        [True, True, False, False],
    ]
    # Same rows without the top_p-only neighbour take the partial-topk path.
    out = process_logits(logits[:1], rows[:1], vocab_size=4)
    assert torch.isfinite(out).tolist() == [[True, True, False, False]]
    torch.testing.assert_close(out.softmax(-1), torch.tensor([[4 / 7, 3 / 7, 0.0, 0.0]]))


def test_top_k_leaves_unfiltered_neighbours_intact():
    torch.manual_seed(4)
    logits = torch.randn(2, 30)
    out = process_logits(logits, [row(top_k=5), row(temperature=1.0)], vocab_size=30)
    assert int(torch.isfinite(out[0]).sum()) == 5
    assert set(out[0].topk(5).indices.tolist()) == set(logits[0].topk(5).indices.tolist())
    torch.testing.assert_close(out[1], logits[1])


def reference_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Which tokens a plain full sort keeps for one row: [V] bool."""
    probs = logits.double().softmax(-1)
    sorted_probs, order = probs.sort(descending=True)
    keep_sorted = (sorted_probs.cumsum(-1) - sorted_probs) < top_p
    return torch.zeros_like(keep_sorted).scatter(0, order, keep_sorted)


def head_and_tail(vocab: int) -> torch.Tensor:
    """10 tokens with 0.06 each, then a flat tail holding 0.4: the top 1024 hold only ~0.74."""
    probs = torch.full((vocab,), 0.4 / (vocab - 10), dtype=torch.float64)
    probs[:10] = 0.06
    return probs.log().float()


@pytest.mark.parametrize("shape", ["peaked", "flat", "head_and_tail"])
def test_top_p_large_vocab_matches_full_sort(shape: str):
    # vocab > NUCLEUS_CANDIDATES: "peaked" and "head_and_tail" rows take the partial-topk path
    # (the latter checks it normalises over the whole row, not the candidates), and the "flat"
    # row's 0.9 nucleus (~2700 tokens) does not fit the candidates, so it falls back to a sort.
    vocab = 3000
    noise = torch.randn(2, vocab, generator=seeded(11))
    if shape == "head_and_tail":
        logits = head_and_tail(vocab).expand(2, vocab) + noise * 1e-3  # break ties
        top_ps = (0.65, 0.5)
    else:
        logits = noise * (6.0 if shape == "peaked" else 0.3)
        top_ps = (0.9, 0.5)
    logits = torch.cat([logits, noise[:1]])  # [3, V]; the last row sets no filter
    rows = [row(top_p=top_ps[0]), row(top_p=top_ps[1]), row()]
    out = process_logits(logits, rows, vocab_size=vocab)
    for i, top_p in enumerate(top_ps):
        expected = reference_top_p(logits[i], top_p)
        assert torch.equal(torch.isfinite(out[i]), expected)
        assert 0 < int(expected.sum()) < vocab
        torch.testing.assert_close(out[i][expected], logits[i][expected])
    if shape == "flat":
        assert int(reference_top_p(logits[0], 0.9).sum()) > NUCLEUS_CANDIDATES
    if shape == "head_and_tail":
        # The nucleus runs into the tail yet ends well inside the candidates.
        assert 10 < int(reference_top_p(logits[0], 0.65).sum()) < NUCLEUS_CANDIDATES
    torch.testing.assert_close(out[2], logits[2])  # the unfiltered neighbour keeps every token


def test_top_p_applies_after_temperature():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    # At temperature 0.5 probs become proportional to p^2: 0.25, 0.0625, 0.0225, 0.01 -> the top
    # token alone has 0.25 / 0.345 = 0.7246 >= 0.7, so only it survives.
    out = process_logits(probs.log().unsqueeze(0), [row(top_p=0.7, temperature=0.5)], 4)[0]
    assert torch.isfinite(out).tolist() == [True, False, False, False]


def test_min_p_drops_tokens_below_fraction_of_max():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    # Threshold 0.2 * 0.5 = 0.1: only the 0.05 token falls below it.
    out = process_logits(probs.log().unsqueeze(0), [row(min_p=0.2)], vocab_size=4)[0]
    assert torch.isfinite(out).tolist() == [True, True, True, False]
    out = process_logits(probs.log().unsqueeze(0), [row(min_p=0.7)], vocab_size=4)[0]
    assert torch.isfinite(out).tolist() == [True, False, False, False]
    tokens = sample_many(probs.log(), 2000, min_p=0.2)
    assert set(tokens) == {0, 1, 2}


def test_filters_are_per_row_in_a_mixed_batch():
    logits = torch.tensor([0.0, 1.0, 2.0, 3.0]).expand(3, 4)
    rows = [row(top_k=1), row(), row(min_p=0.3)]
    out = process_logits(logits, rows, vocab_size=4)
    assert torch.isfinite(out).tolist() == [
        [False, False, False, True],
        [True, True, True, True],
        # e^-1 = 0.37 >= 0.3 but e^-2 = 0.135 < 0.3.
        [False, False, True, True],
    ]


def test_repetition_penalty_on_positive_and_negative_logits():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5]])
    rows = [row(prompt=(0,), output=(1, 1), repetition_penalty=2.0)]
    out = apply_penalties(logits.clone(), rows)
    # Seen: 0 (prompt, positive -> /2) and 1 (output, negative -> *2); others untouched.
    torch.testing.assert_close(out, torch.tensor([[1.0, -4.0, 1.0, -1.0, 0.5]]))


def test_frequency_and_presence_penalties_use_output_counts_only():
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0]])
    rows = [row(prompt=(4, 4), output=(2, 2, 2, 3), frequency_penalty=0.5, presence_penalty=0.25)]
    out = apply_penalties(logits.clone(), rows)
    expected = torch.tensor([[1.0, 1.0, 1.0 - 1.5 - 0.25, 1.0 - 0.5 - 0.25, 1.0]])
    torch.testing.assert_close(out, expected)


def test_penalties_only_touch_rows_that_set_them():
    logits = torch.tensor([[2.0, 2.0], [2.0, 2.0]])
    rows = [row(output=(0,), repetition_penalty=2.0), row(output=(0,))]
    out = apply_penalties(logits.clone(), rows)
    torch.testing.assert_close(out, torch.tensor([[1.0, 2.0], [2.0, 2.0]]))


def test_processing_order_bias_then_repetition_then_frequency():
    logits = torch.tensor([[-2.0, 0.0, 0.0]])
    rows = [row(output=(0,), logit_bias={0: 3.0}, repetition_penalty=2.0, frequency_penalty=0.5)]
    # Bias first: -2 + 3 = 1; repetition (positive) 1 / 2 = 0.5; frequency 0.5 - 0.5 = 0.
    # Penalties before bias would give -4 - 0.5 + 3 = -1.5; frequency before repetition 0.25.
    out = process_logits(logits, rows, vocab_size=3)
    torch.testing.assert_close(out, torch.tensor([[0.0, 0.0, 0.0]]))


def test_greedy_uses_penalised_logits():
    logits = torch.tensor([[3.0, 2.0, 0.0]])
    rows = [row(output=(0,), temperature=0.0, repetition_penalty=2.0)]
    assert Sampler(3)(logits, rows).token_ids == [1]


def test_logprobs_match_raw_log_softmax():
    torch.manual_seed(3)
    logits = torch.randn(3, 40)
    rows = [
        # Forced to a token that is not the raw argmax, so its rank reflects the raw distribution.
        row(temperature=0.0, logit_bias={7: 100.0}, logprobs=5),
        row(logprobs=0, seed=1),
        row(),
    ]
    out = Sampler(40)(logits, rows, default_generator=seeded(0))
    expected = torch.log_softmax(logits, dim=-1)

    first = out.logprobs[0]
    assert first is not None
    assert first.token_id == 7 == out.token_ids[0]
    assert first.logprob == pytest.approx(expected[0, 7].item(), abs=1e-5)
    assert first.rank == int((expected[0] > expected[0, 7]).sum()) + 1
    assert first.rank > 1
    values, ids = expected[0].topk(5)
    assert [t for t, _ in first.top] == ids.tolist()
    assert [v for _, v in first.top] == pytest.approx(values.tolist(), abs=1e-5)

    second = out.logprobs[1]
    assert second is not None
    assert second.top == ()
    assert second.token_id == out.token_ids[1]
    assert second.logprob == pytest.approx(expected[1, second.token_id].item(), abs=1e-5)

    assert out.logprobs[2] is None


def test_logprobs_ignore_temperature_and_filters():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    out = Sampler(3)(logits, [row(temperature=0.3, top_k=1, logprobs=3)])
    entry = out.logprobs[0]
    assert entry is not None
    assert entry.token_id == 0
    assert entry.rank == 1
    assert entry.logprob == pytest.approx(torch.log_softmax(logits[0], -1)[0].item(), abs=1e-5)
    assert len(entry.top) == 3


def test_padded_columns_are_never_sampled_nor_reported():
    vocab, padded = 8, 12
    logits = torch.zeros(200, padded)
    logits[:, vocab:] = 50.0  # would win every draw if it were reachable
    rows = [row(temperature=2.0, logprobs=20) for _ in range(199)] + [row(temperature=0.0)]
    out = Sampler(vocab)(logits, rows, default_generator=seeded(0))
    assert max(out.token_ids) < vocab
    for entry in out.logprobs[:-1]:
        assert entry is not None
        assert len(entry.top) == vocab  # capped by the real vocabulary, not the padded width
        assert all(t < vocab for t, _ in entry.top)
        assert math.fsum(math.exp(v) for _, v in entry.top) == pytest.approx(1.0, abs=1e-5)
        assert entry.logprob == pytest.approx(math.log(1 / vocab), abs=1e-5)


def test_out_of_vocab_ids_in_bias_and_history_are_ignored():
    # Ids 8..11 exist only as padding and 99 nowhere; none may crash the step or be sampled.
    logits = torch.zeros(1, 12)
    rows = [row(output=(9, 99, 3), repetition_penalty=2.0, logit_bias={10: 100.0, 99: 100.0})]
    out = process_logits(logits, rows, vocab_size=8)
    torch.testing.assert_close(out, torch.zeros(1, 8))
    assert Sampler(8)(logits, rows, default_generator=seeded(0)).token_ids[0] < 8


def test_half_precision_logits_are_accepted():
    logits = torch.tensor([[0.0, 4.0, 1.0, 9.0]], dtype=torch.bfloat16)
    out = Sampler(3)(logits, [row(temperature=0.0, logprobs=1)])
    assert out.token_ids == [1]


def test_rejects_mismatched_shapes():
    sampler = Sampler(8)
    with pytest.raises(ValueError):
        sampler(torch.zeros(2, 8), [row()])
    with pytest.raises(ValueError):
        sampler(torch.zeros(1, 4), [row()])
    assert sampler(torch.zeros(0, 8), []).token_ids == []


def test_empirical_distribution_matches_tempered_softmax():
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0])
    temperature = 0.7
    n = 20000
    tokens = sample_many(logits, n, seed=123, temperature=temperature)
    observed = torch.bincount(torch.tensor(tokens), minlength=6).double()
    expected = (logits.double() / temperature).softmax(-1) * n
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    # 5 degrees of freedom: p = 0.001 lies at 20.5. Ignoring the temperature gives chi2 in the
    # hundreds for this n, so the bound still catches a wrong distribution.
    assert chi2 < 30.0, (chi2, observed.tolist(), expected.tolist())
