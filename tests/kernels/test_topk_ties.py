"""`topk_earliest`: the k largest scores with ties at the cut to the earliest positions, equal
to the first k of a stable descending sort and unmoved by keys out of reach after them."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dgpp.kernels.topk_ties import topk_earliest


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 6),
    width=st.integers(1, 40),
    levels=st.integers(1, 4),
    pad=st.integers(0, 30),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_ties_go_to_the_earliest_whatever_follows(
    rows: int, width: int, levels: int, pad: int, seed: int, data: st.DataObject
) -> None:
    k = data.draw(st.integers(0, width))
    generator = torch.Generator().manual_seed(seed)
    # few distinct values: most cuts fall among tied scores (zeros, as a ReLU leaves them)
    scores = torch.randint(0, levels, (rows, width), generator=generator).float().relu()
    want = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
    got = topk_earliest(scores, k)
    assert torch.equal(got, want.sort(dim=-1).values)  # the same set, in increasing order
    padded = torch.cat((scores, torch.full((rows, pad), float("-inf"))), dim=-1)
    assert torch.equal(topk_earliest(padded, k), got)


def test_rows_with_fewer_finite_scores_than_k_take_the_earliest_out_of_reach() -> None:
    scores = torch.tensor([[0.5, float("-inf"), 0.0, float("-inf"), float("-inf")]])
    assert topk_earliest(scores, 3).tolist() == [[0, 1, 2]]
