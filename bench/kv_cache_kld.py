"""What each KV-cache dtype costs in accuracy, dgpp beside llama.cpp's own KV quantization, on the
same GGUF file, text and windows (issue 65):

    .venv/bin/python bench/kv_cache_kld.py [--text FILE] [--context 256] [--top-k 128]

The default model's shipped Q4_1 file on both sides. dgpp: `engine.kv_cache_dtype` int8 (ggml
Q8_0 blocks), fp8_e4m3 (a scale per head) and int4 (Q4_0 blocks) against `auto` (the model
dtype). llama.cpp (llama-cpp-python, the venv bench/gguf_decode.py builds): `-ctk/-ctv` q8_0 and
q4_0 against its default f16 cache, flash attention on for every run (its quantized V cache
needs it). Each engine's KL is against its own reference, over the reference's top K tokens and
one bucket for the rest (`coarse_kl`, as bench/perplexity.py, whose pieces this imports).
Prints a markdown table; docs/quality.md records it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from dgpp.appliance.models.default import install_default
from dgpp.engine.evaluation.eval_scoring import windows
from dgpp.kernels.kv_quant import kv_format

sys.path.insert(0, str(Path(__file__).parent))
from perplexity import (
    dgpp_side,
    kl_cells,
    kl_of,
    peer_side,
    reference_of,
    row,
    text_arguments,
    text_tokens,
)

DGPP_DTYPES = ("int8", "fp8_e4m3", "int4")
PEER_TYPES = ("q8_0", "q4_0")
PEER_BITS = {"f16": 16.0, "q8_0": 8.5, "q4_0": 4.5}  # ggml's blocks: 34 and 18 bytes per 32


def bits_per_value(kv_dtype: str, side: dict) -> float:
    """Stored bits per cached key or value element in dgpp's cache, the scales included."""
    fmt = kv_format(kv_dtype, side["head_dim"])
    return side["dtype_bits"] if fmt is None else 8 * fmt.width / side["head_dim"]


def main() -> None:
    parser = text_arguments(__doc__, 8192, 256, 128)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    shipped = install_default() / "model.gguf"
    tokens = text_tokens(shipped, args.text, args.tokens)
    spans = windows(len(tokens), args.context, args.context // 2)
    computed = sum(s.end - s.begin for s in spans)
    ours = dgpp_side(shipped, tokens, spans, args.top_k, None, kv_cache_dtype="auto")
    rows = [{**row("dgpp auto", ours, None, computed), "bits": bits_per_value("auto", ours)}]
    for kv_dtype in DGPP_DTYPES:
        print(f"dgpp {kv_dtype} ...", file=sys.stderr)
        side = dgpp_side(
            shipped, tokens, spans, args.top_k, reference_of(ours), kv_cache_dtype=kv_dtype
        )
        rows += [{**row(f"dgpp {kv_dtype}", side, ours, computed),
                  "bits": bits_per_value(kv_dtype, side)}]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        peer = {"flash_attn": True}
        theirs = peer_side(shipped, tokens, spans, args.top_k, None, args.threads, work,
                           kv_type="f16", **peer)  # fmt: skip
        np.savez(work / "theirs_ref.npz", top_ids=theirs["top_ids"])
        rows += [{**row("llama.cpp f16", theirs, None, computed), "bits": PEER_BITS["f16"]}]
        for kv_type in PEER_TYPES:
            print(f"llama.cpp {kv_type} ...", file=sys.stderr)
            side = peer_side(shipped, tokens, spans, args.top_k, work / "theirs_ref.npz",
                             args.threads, work, kv_type=kv_type, **peer)  # fmt: skip
            side["kl"] = kl_of(theirs, side["at_reference"])
            rows += [{**row(f"llama.cpp {kv_type}", side, theirs, computed),
                      "bits": PEER_BITS[kv_type]}]  # fmt: skip
    report(rows, args, len(tokens))


def report(rows: list[dict], args: argparse.Namespace, tokens: int) -> None:
    print(
        f"{args.text.name}: {tokens:,} tokens, windows of {args.context} every "
        f"{args.context // 2}, {args.threads} threads; KL against the same engine's reference "
        f"KV cache over its top {args.top_k} + the rest"
    )
    print("| engine, KV cache | bits per value | perplexity (95% interval) | KL mean | KL p99 | "
          "same top | tokens/s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        kl = kl_cells(r, "(reference)")
        print(
            f"| {r['name']} | {r['bits']:g} | {r['ppl']:.4f} ({r['ppl_low']:.3f} to "
            f"{r['ppl_high']:.3f}) | {kl} | {r['tokens_per_s']:,.0f} |"
        )


if __name__ == "__main__":
    main()
