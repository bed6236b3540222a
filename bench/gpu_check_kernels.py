"""Section (a) of the GPU check: every Triton kernel against its PyTorch twin, at a real model's
sizes on the GPU (tiny ones under `--dry-run`): the error as ||out - ref|| / ||ref|| against the
twin run in float64, and the milliseconds of each."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from dgpp.engine.backends.base import BatchLayout, BatchRow
from dgpp.engine.backends.torch_paged import TorchPagedAttention
from dgpp.engine.backends.triton_paged import TritonPagedAttention
from dgpp.kernels.activation_torch import silu_and_mul
from dgpp.kernels.activation_triton import silu_and_mul_triton
from dgpp.kernels.fused_moe_torch import fused_moe
from dgpp.kernels.fused_moe_triton import fused_moe_triton
from dgpp.kernels.group_codes import GroupFormat, GroupWeight, pack_nibbles
from dgpp.kernels.group_linear_torch import group_linear_torch
from dgpp.kernels.group_linear_triton import group_linear_triton
from dgpp.kernels.mla_decode_triton import mla_decode_torch, mla_decode_triton
from dgpp.kernels.paged_attention_torch import paged_attention
from dgpp.kernels.paged_attention_triton import paged_attention_triton
from dgpp.kernels.rms_norm_torch import add_rms_norm, rms_norm
from dgpp.kernels.rms_norm_triton import add_rms_norm_triton, rms_norm_triton
from dgpp.kernels.rope_store_torch import rope_store
from dgpp.kernels.rope_store_triton import rope_store_triton

# Tolerances by dtype (relative error against float64); the interpreter on CPU truncates
# bfloat16 casts, a GPU rounds them.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


@dataclass
class KernelResult:
    name: str
    dtype: str
    error: float
    tolerance: float
    kernel_ms: float
    twin_ms: float

    @property
    def ok(self) -> bool:
        return self.error < self.tolerance


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_ms(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync(device)
    return (time.perf_counter() - start) / repeats * 1e3


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref.double()).norm() / ref.double().norm())


def _attention_step(
    device: torch.device, rows: list[tuple[int, int]], num_decodes: int, heads: int, kv: int,
    dim: int, block: int, prefill_fp32: bool,
) -> tuple[torch.Tensor, torch.Tensor, object]:  # fmt: skip
    gen = torch.Generator(device).manual_seed(0)
    blocks = sum(-(-s // block) for s, _ in rows) + 1
    order = torch.randperm(blocks, generator=gen, device=device).tolist()
    layout_rows = []
    for seq_len, q_len in rows:
        table = [order.pop() for _ in range(-(-seq_len // block))]
        layout_rows.append(BatchRow(seq_len - q_len, q_len, table))
    layout = BatchLayout(tuple(layout_rows), num_decodes, block, prefill_fp32)
    metadata = TorchPagedAttention(device).prepare(layout)
    caches = torch.randn(2, blocks, block, kv, dim, generator=gen, device=device)
    query = torch.randn(sum(q for _, q in rows), heads, dim, generator=gen, device=device)
    return query, caches, metadata


# (name, (seq_len, query_len) rows, decode rows, (heads, KV heads, head dim, page), prefill in
# float32, split-K partition keys)
AttentionCase = tuple[str, list[tuple[int, int]], int, tuple[int, int, int, int], bool, int]


def attention_cases(dry_run: bool) -> list[AttentionCase]:
    if dry_run:
        tiny = (4, 2, 16, 8)
        return [
            ("paged attention, decode", [(40, 1), (23, 1)], 2, tiny, True, 512),
            ("paged attention, decode split-K", [(300, 1)], 1, tiny, True, 64),
            ("paged attention, prefill chunk", [(40, 1), (90, 40)], 1, tiny, False, 512),
        ]
    shape = (32, 8, 128, 16)  # Llama-3-8B-like heads, 16-token pages
    return [
        ("paged attention, decode 16 x 4K", [(4096, 1)] * 16, 16, shape, True, 512),
        ("paged attention, decode 1 x 32K split-K", [(32768, 1)], 1, shape, True, 512),
        ("paged attention, 512-token chunk on 4K fp32", [(4096, 512)], 0, shape, True, 512),
        ("paged attention, 512-token chunk on 4K", [(4096, 512)], 0, shape, False, 512),
    ]


def _measure(
    name: str, dtype: torch.dtype, kernel: Callable[[], object], twin: Callable[[], object],
    reference: torch.Tensor, device: torch.device, repeats: int,
) -> KernelResult:  # fmt: skip
    def first(out: object) -> torch.Tensor:
        return out[0] if isinstance(out, tuple) else out  # type: ignore[return-value]

    error = relative_error(first(kernel()), reference)
    kernel_ms, twin_ms = timed_ms(kernel, device, repeats), timed_ms(twin, device, repeats)
    return KernelResult(name, str(dtype)[6:], error, TOLERANCE[dtype], kernel_ms, twin_ms)


def check_kernels(device: torch.device, dry_run: bool, repeats: int) -> list[KernelResult]:
    results = []
    dtypes = [torch.float32, torch.bfloat16]
    for name, rows, decodes, shape, fp32, partition in attention_cases(dry_run):
        dim = shape[2]
        query, caches, metadata = _attention_step(device, rows, decodes, *shape, fp32)
        scale = dim**-0.5
        ref_inputs = (query.double(), caches[0].double(), caches[1].double(), metadata, scale)
        reference = paged_attention(*ref_inputs)
        for dtype in dtypes:
            inputs = (query.to(dtype), caches[0].to(dtype), caches[1].to(dtype), metadata, scale)
            kernel = partial(paged_attention_triton, *inputs, partition_keys=partition)
            twin = partial(paged_attention, *inputs)
            results.append(_measure(name, dtype, kernel, twin, reference, device, repeats))
    rows, hidden, inter = (6, 96, 160) if dry_run else (4096, 4096, 14336)
    gen = torch.Generator(device).manual_seed(1)
    x = torch.randn(rows, hidden, generator=gen, device=device)
    residual = torch.randn(rows, hidden, generator=gen, device=device)
    weight = 1 + 0.1 * torch.randn(hidden, generator=gen, device=device)
    gate_up = 3 * torch.randn(rows, 2 * inter, generator=gen, device=device)
    references = {
        "norm": rms_norm(x.double(), weight.double(), 1e-6),
        "add": add_rms_norm(x.double(), residual.double(), weight.double(), 1e-6)[0],
        "silu": silu_and_mul(gate_up.double()),
    }
    for dtype in dtypes:
        xs, rs, ws, gs = (t.to(dtype) for t in (x, residual, weight, gate_up))
        cases = [
            (f"RMSNorm {rows} x {hidden}", "norm", partial(rms_norm_triton, xs, ws, 1e-6),
             partial(rms_norm, xs, ws, 1e-6)),
            (f"add + RMSNorm {rows} x {hidden}", "add",
             partial(add_rms_norm_triton, xs, rs, ws, 1e-6),
             partial(add_rms_norm, xs, rs, ws, 1e-6)),
            (f"SiLU-and-mul {rows} x {inter}", "silu", partial(silu_and_mul_triton, gs),
             partial(silu_and_mul, gs)),
        ]  # fmt: skip
        for name, which, kernel, twin in cases:
            results.append(_measure(name, dtype, kernel, twin, references[which], device, repeats))
    results += _group_linear(device, dry_run, repeats)
    results += _fused_moe(device, dry_run, repeats)
    results += _mla_decode(device, dry_run, repeats)
    results += _rope_store(device, dry_run, repeats)
    return results


def _rope_store(device: torch.device, dry_run: bool, repeats: int) -> list[KernelResult]:
    """RoPE with the KV store: Llama-3-8B's 32 query / 8 KV heads of 128 over a 4K chunk; the
    error is the rotated queries' (the cache writes are checked by the CPU tests)."""
    tokens, heads, kv, dim = (7, 6, 2, 16) if dry_run else (4096, 32, 8, 128)
    gen = torch.Generator(device).manual_seed(6)
    qkv = torch.randn(tokens, heads + 2 * kv, dim, generator=gen, device=device)
    angle = torch.rand(tokens, 1, dim // 2, generator=gen, device=device) * 6.28
    angles = (torch.cat((angle.cos(),) * 2, -1), torch.cat((-angle.sin(), angle.sin()), -1))
    slots = torch.randperm(tokens + 64, generator=gen, device=device)[:tokens]
    block = 16
    pages = -(-(tokens + 64) // block)
    wide = (
        qkv.double()[:, :heads],
        qkv.double()[:, heads : heads + kv],
        qkv.double()[:, heads + kv :],
    )
    caches = torch.zeros(2, pages, block, kv, dim, dtype=torch.float64, device=device)
    reference = rope_store(*wide, tuple(a.double() for a in angles), caches[0], caches[1], slots)
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        x, cache = qkv.to(dtype), caches.to(dtype)
        inputs = (x[:, :heads], x[:, heads : heads + kv], x[:, heads + kv :])
        inputs += (tuple(a.to(dtype) for a in angles), cache[0], cache[1], slots)
        name = f"RoPE + KV store {tokens} x {heads}/{kv} heads of {dim}"
        kernel, twin = partial(rope_store_triton, *inputs), partial(rope_store, *inputs)
        results.append(_measure(name, dtype, kernel, twin, reference, device, repeats))
    return results


def _mla_decode(device: torch.device, dry_run: bool, repeats: int) -> list[KernelResult]:
    """DeepSeek-V3's latent attention (128 heads, latent 512 + rope 64) decoding 16 rows of 4K
    context in latent space."""
    heads, rank, rope, length = (20, 32, 16, 40) if dry_run else (128, 512, 64, 4096)
    block = 8 if dry_run else 16
    pages = length // block + 1  # each row's own pages, in order
    rows = [BatchRow(length - 1, 1, list(range(i * pages, (i + 1) * pages))) for i in range(16)]
    layout = BatchLayout(tuple(rows), 16, block, prefill_softmax_fp32=True)
    metadata = TritonPagedAttention(device).prepare(layout)
    gen = torch.Generator(device).manual_seed(5)
    cache = torch.randn(16 * pages, block, rank + rope, generator=gen, device=device)
    q_latent = torch.randn(16, heads, rank, generator=gen, device=device)
    q_pe = torch.randn(16, heads, rope, generator=gen, device=device)
    scale = 192**-0.5
    reference = mla_decode_torch(q_latent.double(), q_pe.double(), cache.double(), metadata, scale)
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        inputs = (q_latent.to(dtype), q_pe.to(dtype), cache.to(dtype), metadata, scale)
        name = f"MLA decode 16 x {length}, {heads} heads, latent {rank} + {rope}"
        kernel, twin = partial(mla_decode_triton, *inputs), partial(mla_decode_torch, *inputs)
        results.append(_measure(name, dtype, kernel, twin, reference, device, repeats))
    return results


def _fused_moe(device: torch.device, dry_run: bool, repeats: int) -> list[KernelResult]:
    """Qwen3-30B-A3B's routed experts (128 of 768 wide, top-8, hidden 2,048) at a decode step
    of 16 tokens and a 1,024-token prefill chunk."""
    hidden, inner, experts, top_k = (64, 32, 8, 2) if dry_run else (2048, 768, 128, 8)
    gen = torch.Generator(device).manual_seed(3)
    w13 = torch.randn(experts, 2 * inner, hidden, generator=gen, device=device) / hidden**0.5
    w2 = torch.randn(experts, hidden, inner, generator=gen, device=device) / inner**0.5
    results = []
    for tokens in (3, 40) if dry_run else (16, 1024):
        x = torch.randn(tokens, hidden, generator=gen, device=device)
        scores = torch.rand(tokens, experts, generator=gen, device=device)
        weights, ids = scores.softmax(-1).topk(top_k, dim=-1)
        reference = fused_moe(x.double(), w13.double(), w2.double(), weights.double(), ids)
        name = f"fused MoE {tokens} tokens, {experts} x {inner} experts top-{top_k}"
        for dtype in (torch.float32, torch.bfloat16):
            inputs = (x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids)
            kernel = partial(fused_moe_triton, *inputs)
            twin = partial(fused_moe, *inputs)
            results.append(_measure(name, dtype, kernel, twin, reference, device, repeats))
    return results


def _group_linear(device: torch.device, dry_run: bool, repeats: int) -> list[KernelResult]:
    """int4 with group scales (GPTQ's symmetric form), x of 16 rows: decode of a batch."""
    rows, cols, group = (64, 256, 64) if dry_run else (4096, 4096, 128)
    gen = torch.Generator(device).manual_seed(2)
    codes = torch.randint(0, 16, (rows, cols), generator=gen, device=device)
    scales = (0.01 + 0.02 * torch.rand(rows, cols // group, generator=gen, device=device)).half()
    fmt = GroupFormat("int4", group, scale_dtype="float16")
    weight = GroupWeight(pack_nibbles(codes), scales)
    x = torch.randn(16, cols, generator=gen, device=device)
    double = GroupWeight(weight.codes, scales.double())
    reference = group_linear_torch(
        x.double(), double, GroupFormat("int4", group, scale_dtype="float32")
    )
    results = []
    # Triton's interpreter multiplies bfloat16 `tl.dot` operands as their raw bits (numpy has no
    # bfloat16): only float32 is meaningful without a GPU.
    dtypes = (torch.float32,) if dry_run else (torch.float32, torch.bfloat16)
    for dtype in dtypes:
        xs = x.to(dtype)
        name = f"int4 g{group} linear 16 x {cols} -> {rows}"
        kernel = partial(group_linear_triton, xs, weight, fmt)
        twin = partial(group_linear_torch, xs, weight, fmt)
        results.append(_measure(name, dtype, kernel, twin, reference, device, repeats))
    return results
