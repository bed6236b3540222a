"""The self-check's attention cases, at the deployment's own shapes: every distinct paged cache
(key/value heads and head dim on this rank) gets a decode, a split-K decode and a prefill chunk
through the paged-attention kernel and one rotary store, a sliding window and sinks where the
family has them; every latent cache a latent decode. Small random inputs, a few pages."""

from __future__ import annotations

from functools import partial

import torch

from dgpp.engine.backends.base import BatchLayout, BatchRow
from dgpp.engine.backends.cache_spec import MLALatentSpec, PagedKVSpec
from dgpp.engine.backends.torch_paged import TorchPagedAttention
from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.configuration.parallel import ParallelContext
from dgpp.engine.models.registry import layer_cache_specs
from dgpp.engine.selfcheck.cases import Case
from dgpp.kernels.dispatch import MLA_DECODE, PAGED_ATTENTION, ROPE_STORE
from dgpp.kernels.kv_quant import KvFormat, kv_format

PAGED_SOURCES = (
    "dgpp.kernels.paged_attention_triton",
    "dgpp.kernels.paged_prefill_triton",
    "dgpp.kernels.paged_decode_split",
    "dgpp.kernels.online_softmax",
    "dgpp.kernels.kv_quant_triton",
    "dgpp.kernels.kv_quant",
)
# (label, (context length, query tokens) per row, decode rows, split-K partition keys)
_STEPS = (
    ("decode", ((37, 1), (22, 1)), 2, 512),
    ("split-K decode", ((150, 1),), 1, 32),
    ("prefill chunk", ((37, 1), (70, 30)), 1, 512),
)


def attention_cases(
    model: ModelConfig, parallel: ParallelContext, block_size: int, dtype: torch.dtype,
    prefill_fp32: bool, device: torch.device, kv_dtype: str = "auto",
) -> list[Case]:  # fmt: skip
    """The cases of the attention kernels this rank's model dispatches, over caches of
    `kv_dtype` (quantized rows: the rotary store is the twin's then, not a kernel)."""
    specs = list(dict.fromkeys(layer_cache_specs(model, parallel, kv_dtype)))
    heads = max(1, model.num_heads // parallel.tp_size)
    raw = model.raw
    window = raw.get("sliding_window") or raw.get("sliding_window_size")
    sinks = raw.get("model_type") in ("gpt_oss", "mimo_v2_flash")
    cases: list[Case] = []
    for spec in specs:
        if isinstance(spec, PagedKVSpec):
            kv, dim = spec.num_kv_heads, spec.head_dim
            query_heads = kv * max(1, heads // kv)
            shape = (query_heads, kv, dim, block_size)
            quant = kv_format(kv_dtype, dim)
            cases += paged_cases(shape, dtype, prefill_fp32, device, None, False, quant)
            windowed = isinstance(window, int) and window > 0
            if windowed or sinks:  # a window shorter than the rows: the window path runs
                short = block_size + 3 if windowed else None
                cases += paged_cases(shape, dtype, prefill_fp32, device, short, sinks, quant)
            if quant is None:
                cases.append(rope_case(query_heads, kv, dim, block_size, dtype, device))
        elif isinstance(spec, MLALatentSpec):
            nope = int(raw.get("qk_nope_head_dim") or spec.kv_lora_rank)
            scale = (nope + spec.rope_dim) ** -0.5
            cases.append(mla_case(heads, spec, block_size, dtype, device, scale))
    return cases


def _layout(
    rows: tuple[tuple[int, int], ...], decodes: int, block: int, fp32: bool, device: torch.device
) -> tuple[BatchLayout, int]:
    gen = torch.Generator(device="cpu").manual_seed(0)
    blocks = sum(-(-length // block) for length, _ in rows) + 1
    order = torch.randperm(blocks, generator=gen).tolist()  # pages out of order
    table_rows = []
    for length, queries in rows:
        table = [order.pop() for _ in range(-(-length // block))]
        table_rows.append(BatchRow(length - queries, queries, table))
    return BatchLayout(tuple(table_rows), decodes, block, fp32), blocks


def _metadata(layout: BatchLayout, device: torch.device) -> object:
    """The Triton backend's metadata of `layout` (the PyTorch one's fields and its own)."""
    from dgpp.engine.backends.triton_paged import TritonPagedAttention  # imports triton

    return TritonPagedAttention(device).prepare(layout)


def paged_cases(
    shape: tuple[int, int, int, int], dtype: torch.dtype, prefill_fp32: bool,
    device: torch.device, window: int | None, sinks: bool, quant: KvFormat | None = None,
) -> list[Case]:  # fmt: skip
    from dgpp.kernels.paged_attention_torch import paged_attention
    from dgpp.kernels.paged_attention_triton import paged_attention_triton

    heads, kv, dim, block = shape
    cases = []
    for name, rows, decodes, partition in _STEPS:
        layout, blocks = _layout(rows, decodes, block, prefill_fp32, device)
        metadata = _metadata(layout, device)
        twin_metadata = TorchPagedAttention(device).prepare(layout)  # with the decode gathers
        gen = torch.Generator(device=device).manual_seed(1)
        caches = torch.randn(2, blocks, block, kv, dim, generator=gen, device=device)
        query = torch.randn(sum(q for _, q in rows), heads, dim, generator=gen, device=device)
        sink = torch.randn(heads, generator=gen, device=device) if sinks else None
        scale = dim**-0.5
        extra = None if sink is None else sink.double()
        if quant is None:
            low, wide = caches.to(dtype), caches.double()
        else:  # the same quantized rows for both; the twin decodes them in float64
            low = wide = quant.encode(caches)
        wide = (query.double(), wide[0], wide[1], twin_metadata, scale)
        inputs = (query.to(dtype), low[0], low[1], metadata, scale)
        label = f"{name}, {heads}/{kv} heads of {dim}, page {block}"
        label += f", window {window}" if window else ""
        label += ", sinks" if sinks else ""
        label += f", {quant.name} cache" if quant is not None else ""
        kernel = partial(
            paged_attention_triton, *inputs, sink, window, partition_keys=partition, kv=quant
        )
        twin = partial(paged_attention, *wide, extra, window, kv=quant)
        cases.append(Case(PAGED_ATTENTION, label, dtype, PAGED_SOURCES, kernel, twin))
    return cases


def rope_case(
    heads: int, kv: int, dim: int, block: int, dtype: torch.dtype, device: torch.device
) -> Case:
    """Rotary embedding with the key/value store of 7 tokens at scattered slots; the rotated
    queries are compared (the stores are checked by the CPU tests)."""
    from dgpp.kernels.rope_store_torch import rope_store
    from dgpp.kernels.rope_store_triton import rope_store_triton

    tokens, pages = 7, 4
    gen = torch.Generator(device=device).manual_seed(2)
    qkv = torch.randn(tokens, heads + 2 * kv, dim, generator=gen, device=device)
    angle = torch.rand(tokens, 1, dim // 2, generator=gen, device=device) * 6.28
    angles = (torch.cat((angle.cos(),) * 2, -1), torch.cat((-angle.sin(), angle.sin()), -1))
    slots = torch.randperm(pages * block, generator=gen, device=device)[:tokens]

    def inputs(kind: torch.dtype) -> tuple:
        x = qkv.to(kind)
        cache = torch.zeros(2, pages, block, kv, dim, dtype=kind, device=device)
        parts = (x[:, :heads], x[:, heads : heads + kv], x[:, heads + kv :])
        return (*parts, tuple(a.to(kind) for a in angles), cache[0], cache[1], slots)

    label = f"{tokens} tokens, {heads}/{kv} heads of {dim}"
    run, twin = (
        partial(rope_store_triton, *inputs(dtype)),
        partial(rope_store, *inputs(torch.double)),
    )
    return Case(ROPE_STORE, label, dtype, ("dgpp.kernels.rope_store_triton",), run, twin)


def mla_case(
    heads: int, spec: MLALatentSpec, block: int, dtype: torch.dtype, device: torch.device,
    scale: float,
) -> Case:  # fmt: skip
    """Latent decode of 3 rows over a few pages each."""
    from dgpp.kernels.mla_decode_triton import mla_decode_torch, mla_decode_triton

    length, rank, rope = 3 * block - 5, spec.kv_lora_rank, spec.rope_dim
    pages = -(-length // block)
    rows = [BatchRow(length - 1, 1, list(range(i * pages, (i + 1) * pages))) for i in range(3)]
    layout = BatchLayout(tuple(rows), 3, block, prefill_softmax_fp32=True)
    metadata = _metadata(layout, device)
    gen = torch.Generator(device=device).manual_seed(3)
    cache = torch.randn(3 * pages, block, rank + rope, generator=gen, device=device).to(dtype)
    q_latent = torch.randn(3, heads, rank, generator=gen, device=device)
    q_pe = torch.randn(3, heads, rope, generator=gen, device=device)
    fmt = spec.row_format  # quantized latents: the twin reads their dequantized values
    stored = cache if fmt is None else fmt.encode(cache.flatten(0, 1)).view(3 * pages, block, -1)
    values = cache if fmt is None else fmt.decode(stored, dtype)
    wide = (q_latent.double(), q_pe.double(), values.double(), metadata, scale)
    inputs = (q_latent.to(dtype), q_pe.to(dtype), stored, metadata, scale, fmt)
    label = f"decode, 3 rows, {heads} heads, latent {rank} + rope {rope}, page {block}"
    label += "" if fmt is None else f", {spec.kv_dtype} latents"
    run, twin = partial(mla_decode_triton, *inputs), partial(mla_decode_torch, *wide)
    return Case(MLA_DECODE, label, dtype, ("dgpp.kernels.mla_decode_triton",), run, twin)
