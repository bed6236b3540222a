"""Prefill attention on CPU: the compiled kernel that reads the paged cache in place
(kernels/cpu/paged_attention.cpp) against the PyTorch twin it replaced (context gathered, then
SDPA with a causal mask), one layer of the default model's shape (9 query heads, 3 KV heads, head
dim 64, 16-token blocks, a scattered block table), in one run:

    python bench/paged_attention_cpu.py [--contexts 2000,6000] [--chunks 1,16,64,256,512]

A chunk of C tokens ending at position S (the interactive policy's short chunks deep in a long
prompt are the small C; a whole-budget chunk the large). Milliseconds per call, median of 5 runs
of 10 calls each, and the twin's time over the kernel's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from dgpp.kernels.attention_metadata import PagedAttentionMetadata
from dgpp.kernels.paged_attention_cpu import cpu_extension, paged_attention_cpu
from dgpp.kernels.paged_attention_torch import paged_attention

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16


def _step(seq_len: int, chunk: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seq_len + chunk)
    blocks = -(-seq_len // BLOCK)
    key_cache = torch.randn(blocks + 8, BLOCK, KV_HEADS, DIM, generator=generator)
    value_cache = torch.randn_like(key_cache)
    table = torch.randperm(blocks + 8, generator=generator)[:blocks]
    metadata = PagedAttentionMetadata(
        slot_mapping=torch.zeros(chunk, dtype=torch.int64),
        block_tables=table.unsqueeze(0),
        query_start_loc=torch.tensor([0, chunk]),
        seq_lens=torch.tensor([seq_len]),
        query_start_loc_host=(0, chunk),
        seq_lens_host=(seq_len,),
        num_decodes=0,
        max_seq_len=seq_len,
        prefill_softmax_fp32=True,
    )
    query = torch.randn(chunk, HEADS, DIM, generator=generator)
    return query, key_cache, value_cache, metadata


def _ms(call: Callable[[], object]) -> float:
    call()
    runs = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(10):
            call()
        runs.append((time.perf_counter() - started) / 10 * 1e3)
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", default="2000,6000")
    parser.add_argument("--chunks", default="1,16,64,256,512")
    args = parser.parse_args()
    assert cpu_extension() is not None, "the paged attention CPU kernel did not build"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ms per layer")
    print("| context | chunk | twin (gather + SDPA) | kernel | twin / kernel |")
    print("|---|---|---|---|---|")
    for seq_len in (int(s) for s in args.contexts.split(",")):
        for chunk in (int(c) for c in args.chunks.split(",")):
            inputs = (*_step(seq_len, chunk), DIM**-0.5)
            twin = _ms(partial(paged_attention, *inputs))
            kernel = _ms(partial(paged_attention_cpu, *inputs))
            print(f"| {seq_len} | {chunk} | {twin:.2f} | {kernel:.2f} | {twin / kernel:.2f}x |")


if __name__ == "__main__":
    main()
