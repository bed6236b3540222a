"""The self-check's cases of the kernels that run on the loaded model's weights, at its own
shapes: RMSNorm over the hidden size, SiLU-and-mul over this rank's MLP width, the fused MoE
over the first experts of a routed layer (a decode-sized and a prefill-sized step: both rows of
the tile table), each distinct group-quantized format on a slice of a real layer's weight, and
fla's Gated DeltaNet kernels where they serve. Run after the weights reach the device and before
the layers pick their kernels."""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial

import torch
from torch import nn

from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.configuration.parallel import ParallelContext
from dgpp.engine.layers.group_weight import group_weight
from dgpp.engine.layers.linear import PackableLinear
from dgpp.engine.layers.moe import Experts
from dgpp.engine.selfcheck.cases import Case
from dgpp.kernels import dispatch as kernel
from dgpp.kernels.group_codes import GroupFormat, GroupWeight

_ROWS = 64  # output rows of a group-quantized weight's slice
_MOE_EXPERTS = 8  # experts of a routed layer's slice


def weight_cases(
    model: nn.Module, config: ModelConfig, parallel: ParallelContext, dtype: torch.dtype,
    device: torch.device,
) -> list[Case]:  # fmt: skip
    cases = norm_cases(config.hidden_size, dtype, device)
    inner = max(1, config.intermediate_size // parallel.tp_size)
    cases.append(silu_case(inner, dtype, device))
    experts = next((m for m in model.modules() if isinstance(m, Experts)), None)
    if experts is not None:
        cases += moe_cases(experts, dtype, device)
    cases += group_cases(model.modules(), dtype, device)
    cases += delta_cases(model, dtype, device)
    return cases


def _gen(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def norm_cases(hidden: int, dtype: torch.dtype, device: torch.device) -> list[Case]:
    from dgpp.kernels.rms_norm_torch import add_rms_norm, rms_norm
    from dgpp.kernels.rms_norm_triton import add_rms_norm_triton, rms_norm_triton

    gen = _gen(device, 4)
    x, residual = (torch.randn(5, hidden, generator=gen, device=device) for _ in range(2))
    weight = 1 + 0.1 * torch.randn(hidden, generator=gen, device=device)
    low = (x.to(dtype), residual.to(dtype), weight.to(dtype))
    wide = (x.double(), residual.double(), weight.double())
    sources = ("dgpp.kernels.rms_norm_triton",)
    norm = partial(rms_norm_triton, low[0], low[2], 1e-6)
    add = partial(add_rms_norm_triton, *low, 1e-6)
    return [
        Case(kernel.RMS_NORM, f"5 x {hidden}", dtype, sources, norm,
             partial(rms_norm, wide[0], wide[2], 1e-6)),
        Case(kernel.RMS_NORM, f"add + norm 5 x {hidden}", dtype, sources, add,
             partial(add_rms_norm, *wide, 1e-6)),
    ]  # fmt: skip


def silu_case(inner: int, dtype: torch.dtype, device: torch.device) -> Case:
    from dgpp.kernels.activation_torch import silu_and_mul
    from dgpp.kernels.activation_triton import silu_and_mul_triton

    gate_up = 3 * torch.randn(5, 2 * inner, generator=_gen(device, 5), device=device)
    run = partial(silu_and_mul_triton, gate_up.to(dtype))
    twin = partial(silu_and_mul, gate_up.double())
    return Case(
        kernel.SILU_AND_MUL, f"5 x {inner}", dtype, ("dgpp.kernels.activation_triton",), run, twin
    )


def moe_cases(experts: Experts, dtype: torch.dtype, device: torch.device) -> list[Case]:
    """The layer's first experts, with its activation and biases, at 3 tokens (a few rows per
    expert: the decode tiles) and 80 (about 20: the prefill tiles)."""
    from dgpp.kernels.fused_moe_torch import fused_moe
    from dgpp.kernels.fused_moe_triton import fused_moe_triton

    count = min(_MOE_EXPERTS, experts.num_experts)
    spec = experts.spec
    top_k = min(spec.router.top_k, count, 2)
    w13, w2 = experts.gate_up_proj[:count].detach(), experts.down_proj[:count].detach()
    bias = getattr(experts, "gate_up_proj_bias", None)
    bias = None if bias is None else bias[:count].detach()
    act = (spec.activation, spec.swiglu_alpha, spec.swiglu_limit)
    sources = ("dgpp.kernels.fused_moe_triton", "dgpp.kernels.moe_align", "dgpp.kernels.moe_tiles")
    gen, cases = _gen(device, 6), []
    for tokens in (3, 80):
        x = torch.randn(tokens, w13.shape[-1], generator=gen, device=device)
        scores = torch.rand(tokens, count, generator=gen, device=device)
        weights, ids = scores.softmax(-1).topk(top_k, dim=-1)
        low = (x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids, *act)
        wide = (x.double(), w13.double(), w2.double(), weights.double(), ids, *act)
        label = f"{tokens} tokens, {count} of {w2.shape[-1]}-wide experts, top-{top_k}"
        run = partial(fused_moe_triton, *low, None if bias is None else bias.to(dtype))
        twin = partial(fused_moe, *wide, None if bias is None else bias.double())
        cases.append(Case(kernel.FUSED_MOE, label, dtype, sources, run, twin))
    return cases


def _rows(weight: GroupWeight, rows: int) -> GroupWeight:
    """The first `rows` output rows of a packed weight."""
    scale = weight.global_scale
    per_row = scale is not None and scale.dim() == 1 and scale.numel() > 1
    return GroupWeight(
        weight.codes[:rows], weight.scales[:rows],
        None if weight.zeros is None else weight.zeros[:rows],
        scale[:rows] if per_row else scale, weight.perm,
    )  # fmt: skip


def group_cases(
    modules: Iterable[nn.Module], dtype: torch.dtype, device: torch.device
) -> list[Case]:
    """One case per distinct group format, on the first layer of that format: the kernel the
    layer would pick on this device (the FP8 GEMM or the Triton dequantize-GEMM)."""
    from dgpp.kernels.fp8_linear import fp8_linear_scaled_mm, fp8_linear_torch, scaled_mm_usable
    from dgpp.kernels.group_linear_torch import group_linear_torch

    seen: dict[GroupFormat, PackableLinear] = {}
    for module in modules:
        fmt = getattr(module, "weight_format", None)
        if isinstance(module, PackableLinear) and isinstance(fmt, GroupFormat):
            seen.setdefault(fmt, module)
    cases = []
    for fmt, module in seen.items():
        weight = _rows(group_weight(module), _ROWS)
        x = torch.randn(4, module.in_features, generator=_gen(device, 7), device=device)
        label = f"{fmt.codebook} g{fmt.group_size} 4 x {module.in_features} -> {_ROWS}"
        if device.type == "cuda" and scaled_mm_usable(weight, fmt, device):
            run = partial(fp8_linear_scaled_mm, x.to(dtype), weight, fmt)
            twin = partial(fp8_linear_torch, x.float(), weight, fmt)
            cases.append(
                Case(kernel.FP8_SCALED_MM, label, dtype, ("dgpp.kernels.fp8_linear",), run, twin)
            )
            continue
        from dgpp.kernels.group_linear_triton import group_linear_triton

        run = partial(group_linear_triton, x.to(dtype), weight, fmt)
        twin = partial(group_linear_torch, x.float(), weight, fmt)
        sources = ("dgpp.kernels.group_linear_triton", "dgpp.kernels.group_codes")
        cases.append(Case(kernel.GROUP_LINEAR, label, dtype, sources, run, twin))
    return cases


def delta_cases(model: nn.Module, dtype: torch.dtype, device: torch.device) -> list[Case]:
    """fla-core's chunked Gated DeltaNet kernel (prefill) and its recurrent one (decode)
    against dgpp's twins, at the first Gated DeltaNet layer's heads, where fla serves."""
    from dgpp.kernels.gated_delta import TORCH_FNS, select_gated_delta

    layer = next(
        (m for m in model.modules() if hasattr(m, "k_heads") and hasattr(m, "v_heads")), None
    )
    if layer is None or select_gated_delta(device) is TORCH_FNS:
        return []
    fla = select_gated_delta(device)
    heads, dk, dv = layer.v_heads, layer.spec.head_k_dim, layer.spec.head_v_dim
    gen, cases = _gen(device, 8), []
    steps = (("chunk", fla.chunk, TORCH_FNS.chunk, 40),)
    steps += (("recurrent", fla.recurrent, TORCH_FNS.recurrent, 1),)
    for name, fn, twin_fn, tokens in steps:
        q, k = (torch.randn(1, tokens, heads, dk, generator=gen, device=device) for _ in range(2))
        v = torch.randn(1, tokens, heads, dv, generator=gen, device=device)
        g = -torch.rand(1, tokens, heads, generator=gen, device=device)
        beta = torch.rand(1, tokens, heads, generator=gen, device=device)
        state = torch.randn(1, heads, dk, dv, generator=gen, device=device) * 0.1
        low = (q.to(dtype), k.to(dtype), v.to(dtype), g, beta, state, None, True)
        wide = (q.float(), k.float(), v.float(), g, beta, state, None, True)
        label = f"{name}, {tokens} tokens, {heads} heads of {dk}/{dv}"
        cases.append(
            Case(
                kernel.GATED_DELTA,
                label,
                dtype,
                ("fla",),
                partial(fn, *low),
                partial(twin_fn, *wide),
            )
        )
    return cases
