"""The routed experts of a MoE layer as two grouped GEMMs over every expert at once (Triton):
the twin of `fused_moe_torch.fused_moe`, same signature.

The assignments are laid out by expert in blocks on the device (`moe_align.align_by_expert`);
one program computes a block of one expert's rows against a tile of its weights, the expert read
from the block's entry, so the launch covers all experts and no count is read on the host (a
step can be captured in a CUDA graph). The first kernel computes the gate and up tiles together
and applies the activation (SiLU, gpt-oss's or DeepSeek-V4's clamped SwiGLU) before storing the
intermediate; the second multiplies by the down weights and the routing weight and stores each
assignment's row, and the k rows of each token are summed after (deterministic, no atomics).
Accumulation is float32 (the products too for float32 rows); tiles come from `moe_tiles` (per
architecture, within GB10's shared memory).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dgpp.kernels.dispatch import float32_products
from dgpp.kernels.moe_align import align_by_expert
from dgpp.kernels.moe_tiles import moe_tiles

_ACTIVATIONS = {"silu": 0, "swiglu_oai": 1, "swiglu_clamp": 2}
_empty = torch.empty  # the kernels' outputs (tests poison them: an unwritten row shows)


@triton.jit
def _gate_up_kernel(
    x_ptr: tl.tensor,
    w_ptr: tl.tensor,
    bias_ptr: tl.tensor,
    out_ptr: tl.tensor,
    rows_ptr: tl.tensor,
    block_expert_ptr: tl.tensor,
    num_assignments: int,
    top_k: int,
    hidden: int,
    inner: int,
    stride_xt: int,
    stride_we: int,
    stride_wn: int,
    stride_be: int,
    stride_ot: int,
    alpha: float,
    limit: float,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    F32_DOT: tl.constexpr,
) -> None:
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert >= 0:
        offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
        assignment = tl.load(rows_ptr + offs_m)
        valid = assignment < num_assignments
        token = tl.where(valid, assignment // top_k, 0)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < inner
        w_at = w_ptr + expert * stride_we
        gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for start in range(0, hidden, BLOCK_K):
            offs_k = start + tl.arange(0, BLOCK_K)
            k_ok = offs_k < hidden
            x = tl.load(
                x_ptr + token[:, None] * stride_xt + offs_k[None, :],
                mask=valid[:, None] & k_ok[None, :],
                other=0.0,
            )
            w_mask = k_ok[:, None] & n_ok[None, :]
            w_gate = tl.load(
                w_at + offs_n[None, :] * stride_wn + offs_k[:, None], mask=w_mask, other=0.0
            )
            w_up = tl.load(
                w_at + (offs_n[None, :] + inner) * stride_wn + offs_k[:, None],
                mask=w_mask,
                other=0.0,
            )
            if F32_DOT:  # float32 products, no TF32 rounding (float32 rows; the interpreter)
                x = x.to(tl.float32)
                gate = tl.dot(x, w_gate.to(tl.float32), gate, input_precision="ieee")
                up = tl.dot(x, w_up.to(tl.float32), up, input_precision="ieee")
            else:
                gate = tl.dot(x, w_gate, gate)
                up = tl.dot(x, w_up, up)
        if HAS_BIAS:
            b_at = bias_ptr + expert * stride_be
            gate += tl.load(b_at + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            up += tl.load(b_at + inner + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if ACTIVATION == 0:
            act = gate / (1.0 + tl.exp(-gate)) * up
        else:
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
            if ACTIVATION == 1:
                act = (up + 1.0) * gate / (1.0 + tl.exp(-gate * alpha))
            else:
                act = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(
            out_ptr + offs_m[:, None] * stride_ot + offs_n[None, :],
            act.to(out_ptr.dtype.element_ty),
            mask=n_ok[None, :],
        )


@triton.jit
def _down_kernel(
    act_ptr: tl.tensor,
    w_ptr: tl.tensor,
    weights_ptr: tl.tensor,
    out_ptr: tl.tensor,
    rows_ptr: tl.tensor,
    block_expert_ptr: tl.tensor,
    num_assignments: int,
    hidden: int,
    inner: int,
    stride_at: int,
    stride_we: int,
    stride_wn: int,
    stride_ot: int,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    F32_DOT: tl.constexpr,
) -> None:
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert >= 0:
        offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
        assignment = tl.load(rows_ptr + offs_m)
        valid = assignment < num_assignments
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hidden
        w_at = w_ptr + expert * stride_we
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for start in range(0, inner, BLOCK_K):
            offs_k = start + tl.arange(0, BLOCK_K)
            k_ok = offs_k < inner
            a = tl.load(
                act_ptr + offs_m[:, None] * stride_at + offs_k[None, :],
                mask=k_ok[None, :],
                other=0.0,
            )
            w = tl.load(
                w_at + offs_n[None, :] * stride_wn + offs_k[:, None],
                mask=k_ok[:, None] & n_ok[None, :],
                other=0.0,
            )
            if F32_DOT:
                a, w = a.to(tl.float32), w.to(tl.float32)
                acc = tl.dot(a, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, w, acc)
        weight = tl.load(weights_ptr + assignment, mask=valid, other=0.0).to(tl.float32)
        acc = acc * weight[:, None]
        tl.store(
            out_ptr + assignment[:, None] * stride_ot + offs_n[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=valid[:, None] & n_ok[None, :],
        )


def fused_moe_triton(
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
    """As `fused_moe_torch.fused_moe`: hidden [T, H], w13 [E, 2I, H], w2 [E, H, I], routing
    weights and ids [T, k] -> [T, H]."""
    num_tokens, width = hidden.shape
    num_experts, inner = w13.shape[0], w2.shape[-1]
    top_k = topk_ids.shape[1]
    num = num_tokens * top_k
    for tensor in (hidden, w13, w2):
        assert tensor.stride(-1) == 1, "rows are contiguous"
    if num == 0:
        return torch.zeros_like(hidden)
    tiles = moe_tiles(num, num_experts, hidden.device, hidden.element_size())
    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
    rows, block_expert = align_by_expert(topk_ids, num_experts, bm)
    num_blocks = block_expert.shape[0]
    act = _empty(rows.shape[0], inner, dtype=hidden.dtype, device=hidden.device)
    f32_dot = float32_products(hidden.dtype)
    launch = dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    _gate_up_kernel[(num_blocks, triton.cdiv(inner, bn))](
        hidden, w13, w13_bias if w13_bias is not None else w13, act, rows, block_expert,
        num, top_k, width, inner,
        hidden.stride(0), w13.stride(0), w13.stride(1),
        w13_bias.stride(0) if w13_bias is not None else 0, act.stride(0),
        alpha, limit,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        ACTIVATION=_ACTIVATIONS[activation], HAS_BIAS=w13_bias is not None, F32_DOT=f32_dot,
        **launch,
    )  # fmt: skip
    out = _empty(num, width, dtype=hidden.dtype, device=hidden.device)
    weights = topk_weights.reshape(-1).contiguous()
    _down_kernel[(num_blocks, triton.cdiv(width, bn))](
        act, w2, weights, out, rows, block_expert,
        num, width, inner,
        act.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, F32_DOT=f32_dot,
        **launch,
    )  # fmt: skip
    return out.view(num_tokens, top_k, width).sum(dim=1)
