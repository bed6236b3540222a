"""A sliding window's keys and values kept in a state slot at `engine.kv_cache_dtype`
(`layers.window_kv`, `layers.state_rows`): at every dtype the layer equals windowed attention
over each key and value rounded through that dtype's format (PyTorch's SDPA, an independent
reference), through prefill chunks shorter than the prompt that continue a slot, decode rows,
and a verify row whose positions read and write draft slots; the slot holds the format's
bytes, not float32 (its size is checked)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dgpp.engine.backends.state_cache import LinearStateBackend, StateRows, VerifyPosition
from dgpp.engine.layers import state_rows
from dgpp.engine.layers.window_kv import WindowAttention, WindowStateSpec

HEADS, KV_HEADS, DIM, V_DIM, WINDOW = 4, 2, 64, 32, 8


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of q [T, H, D] over the last WINDOW keys, each query's own included."""
    t = torch.arange(q.shape[0])
    mask = (t[None] <= t[:, None]) & (t[None] > t[:, None] - WINDOW)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), mask, scale=DIM**-0.5,
        enable_gqa=True,
    )  # fmt: skip
    return out.transpose(0, 1)


def _rows(
    decode: list[int] | None = None,
    prefills: tuple[tuple[int, int, int, bool], ...] = (),
    starts: tuple[int, ...] = (),
    verify: tuple[VerifyPosition, ...] = (),
) -> dict[str, StateRows]:
    slots = None if decode is None else torch.tensor(decode)
    return {"linear-state": StateRows(slots, prefills, verify, starts)}


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "fp8_e4m3", "int4"])
def test_the_window_reads_back_each_row_as_its_format_stores_it(kv_dtype: str) -> None:
    backend = LinearStateBackend(torch.device("cpu"), kv_dtype)
    layer = WindowAttention(HEADS, KV_HEADS, DIM, V_DIM, DIM**-0.5, WINDOW, backend)
    spec = layer.spec
    assert spec == WindowStateSpec(KV_HEADS, DIM, V_DIM, WINDOW - 1, kv_dtype)
    auto = WindowStateSpec(KV_HEADS, DIM, V_DIM, WINDOW - 1)
    if kv_dtype != "auto":  # bytes per head, not float32: int8 and fp8 < 0.3x, int4 < 0.17x
        assert spec.bytes_per_slot() < (0.17 if kv_dtype == "int4" else 0.3) * auto.bytes_per_slot()
    layer.bind_state(spec.allocate(1, 4, torch.device("cpu"))[0])
    gen = torch.Generator().manual_seed(7)
    total = 30
    q = torch.randn(2, total, HEADS, DIM, generator=gen)
    k = torch.randn(2, total, KV_HEADS, DIM, generator=gen)
    v = torch.randn(2, total, KV_HEADS, V_DIM, generator=gen)
    key_format, value_format = spec.formats
    rounded_k = state_rows.decode(state_rows.encode(k, key_format), key_format)
    rounded_v = state_rows.decode(state_rows.encode(v, value_format), value_format)
    want = [_reference(q[s], rounded_k[s], rounded_v[s]) for s in (0, 1)]
    got = torch.empty(2, total, HEADS, V_DIM)

    def run(metadata: dict[str, StateRows], parts: list[tuple[int, slice]]) -> None:
        """One step over (sequence, positions) parts, in the order the metadata lists them."""
        pieces = [(q[s, at], k[s, at], v[s, at]) for s, at in parts]
        out = layer(*(torch.cat(p) for p in zip(*pieces, strict=True)), metadata)
        sizes = [piece[0].shape[0] for piece in pieces]
        for (s, at), chunk in zip(parts, out.split(sizes), strict=True):
            got[s, at] = chunk

    # Prompts in chunks shorter than them (13 then 9; 5, 6 and 11 for the second).
    run(_rows(prefills=((0, 13, 0, False), (13, 18, 1, False)), starts=(0, 0)),
        [(0, slice(0, 13)), (1, slice(0, 5))])  # fmt: skip
    run(_rows(prefills=((0, 9, 0, True), (9, 15, 1, True)), starts=(13, 5)),
        [(0, slice(13, 22)), (1, slice(5, 11))])  # fmt: skip
    run(_rows(prefills=((0, 11, 1, True),), starts=(11,)), [(1, slice(11, 22))])
    for step in range(22, 27):  # decode rows of both
        run(_rows([0, 1]), [(0, slice(step, step + 1)), (1, slice(step, step + 1))])
    # A verify row of three tokens for sequence 0: draft slots 2 and 3 hold positions 0 and 1.
    verify = tuple(
        VerifyPosition(torch.tensor([j]), torch.tensor([reads]), torch.tensor([writes]))
        for j, (reads, writes) in enumerate(((0, 2), (2, 3), (3, 0)))
    )
    run(_rows(verify=verify), [(0, slice(27, 30))])
    torch.testing.assert_close(got[0], want[0], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(got[1, :27], want[1][:27], atol=2e-5, rtol=1e-5)
    if kv_dtype != "auto":  # a wrong format would show against the unrounded reference
        assert (got[0] - _reference(q[0], k[0], v[0])).abs().max() > 1e-4
