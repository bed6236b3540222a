"""The routed experts of a mixture-of-experts layer in PyTorch: the twin of
`fused_moe_triton.fused_moe_triton` and the CPU path.

Stacked weights: `w13` [E, 2I, H] (each expert's gate rows, then its up rows) and `w2`
[E, H, I]; a token's output is sum_k weight[t, k] * w2[e] @ act(w13[e] @ x[t]) over its top-k
experts e = ids[t, k]. The down projection's bias (gpt-oss) is not included: added once after
the ranks' partial sums are reduced.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def moe_activation(
    gate_up: torch.Tensor, activation: str, alpha: float = 1.702, limit: float = 7.0
) -> torch.Tensor:
    """act(gate) * up over [.., 2I] (gate half first): SiLU; gpt-oss's clamped SwiGLU
    (`swiglu_oai`: gate clamped above at `limit`, up to [-limit, limit], (up + 1) * gate *
    sigmoid(alpha * gate)); or DeepSeek-V4's (`swiglu_clamp`: the same clamps, then plain
    silu(gate) * up)."""
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    assert activation in ("swiglu_oai", "swiglu_clamp"), f"unknown expert activation {activation!r}"
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    if activation == "swiglu_clamp":
        return F.silu(gate) * up
    return (up + 1) * gate * torch.sigmoid(gate * alpha)


def grouped_by_expert(
    hidden: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    num_experts: int,
    expert: Callable[[int, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """sum_k weights[t, k] * expert(ids[t, k], hidden[t]) for every token t [T, H], calling
    `expert(e, rows)` once per expert that has tokens, on all of its rows at once. Counts the
    tokens of each expert on the host (a synchronisation: not for CUDA graphs)."""
    top_k = ids.shape[1]
    flat = ids.reshape(-1)  # [T * k]
    order = torch.argsort(flat, stable=True)  # assignments grouped by expert
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    tokens = order // top_k
    routed = hidden.index_select(0, tokens)  # [T * k, H]
    out = torch.empty_like(routed)
    start = 0
    for index, count in enumerate(counts):
        if count:
            out[start : start + count] = expert(index, routed[start : start + count])
            start += count
    out.mul_(weights.reshape(-1).index_select(0, order).unsqueeze(1).to(out.dtype))
    return torch.zeros_like(hidden).index_add_(0, tokens, out)


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
    w13_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """hidden [T, H], routing weights and expert ids [T, k] -> the weighted sum of the routed
    experts' outputs [T, H] (`w13_bias` [E, 2I] is added to the gate/up product)."""

    def expert(index: int, rows: torch.Tensor) -> torch.Tensor:
        bias = None if w13_bias is None else w13_bias[index]
        inner = moe_activation(F.linear(rows, w13[index], bias), activation, alpha, limit)
        return F.linear(inner, w2[index])

    return grouped_by_expert(hidden, topk_weights, topk_ids, w13.shape[0], expert)
