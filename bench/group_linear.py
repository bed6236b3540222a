"""The group-quantized CPU kernel (kernels/cpu/group_linear.cpp) against float32 `F.linear` and
against its PyTorch twin, on the default model's layer shapes (hidden 576, intermediate 1536:
fused q/k/v 960x576, o 576x576, fused gate/up 3072x576, down 576x1536), 30 layers cycled so the
weights stream from memory as in a real decode step:

    python bench/group_linear.py [--rows 1 8 128] [--threads N] [--gemm-rows G]

Formats (random codes, realistic scale layouts): uint4 with zero codes and float16 scales in
groups of 64 (GPTQ/AWQ; 128 does not divide the 576 input columns), e2m1 in groups of 16 with
float16 scales and a global scale (NVFP4), e4m3 with one float32 scale per output row (FP8
per-channel). "float32 scales" rows pass the same weights with their effective scales already in
float32 (what a load-time preparation step would produce), to show whether one is worth having.
Reported: milliseconds per 30-layer pass (median of timed passes after one warm-up; passes with
128 rows time 3 layers and report 10 times that) and the ratio to `F.linear`. `--gemm-rows`
overrides where the kernel switches to dequantized tiles + ATen GEMM (to measure that crossover).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from dgpp.kernels import group_linear_cpu as cpu
from dgpp.kernels.group_codes import GroupFormat, GroupWeight, effective_scales, pack_nibbles
from dgpp.kernels.group_linear_torch import group_linear_torch

LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate/up, down
LAYERS = 30
FORMATS = {
    "uint4+zeros g64": GroupFormat("uint4", 64),
    "e2m1 g16 +global": GroupFormat("e2m1", 16, "div"),
    "e4m3 per channel": GroupFormat("e4m3", 0),  # group size: the input width, set per shape
}


def _weight(fmt: GroupFormat, rows: int, cols: int, gen: torch.Generator) -> GroupWeight:
    groups = cols // fmt.group_size
    if fmt.bits == 8:
        codes = torch.randint(0, 256, (rows, cols), generator=gen, dtype=torch.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0x7E
    else:
        codes = pack_nibbles(torch.randint(0, 16, (rows, cols), generator=gen))
    if fmt.codebook == "e2m1":
        raw = torch.randint(0x08, 0x7F, (rows, groups), generator=gen, dtype=torch.uint8)
        scales = raw.view(torch.float8_e4m3fn).to(torch.float16)
        return GroupWeight(codes, scales, global_scale=torch.tensor(2688.0 / 0.3))
    scales = torch.rand(rows, groups, generator=gen) * 0.01 + 1e-3
    if fmt.codebook == "e4m3":
        return GroupWeight(codes, scales)
    zeros = torch.randint(0, 16, (rows, groups), generator=gen, dtype=torch.uint8)
    return GroupWeight(codes, scales.to(torch.float16), zeros)


def _prepared(weight: GroupWeight, fmt: GroupFormat) -> GroupWeight:
    """The same weight with float32 effective scales and no global scale."""
    return weight._replace(scales=effective_scales(weight, fmt), global_scale=None)


def _time(calls: list[Callable[[], object]], passes: int) -> float:
    """Median milliseconds of one pass over `calls`, after one warm-up pass."""
    for call in calls:
        call()
    times = []
    for _ in range(passes):
        started = time.perf_counter()
        for call in calls:
            call()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 128], help="rows of x")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--passes", type=int, default=5, help="timed passes per cell")
    parser.add_argument("--gemm-rows", type=int, default=cpu.GEMM_ROWS)
    parser.add_argument("--no-twin", action="store_true", help="skip the (slow) twin rows")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cpu.GEMM_ROWS = args.gemm_rows
    assert cpu.cpu_extension() is not None, "the group-quantized CPU kernel did not build"

    gen = torch.Generator().manual_seed(0)
    dense = {s: torch.randn(s, generator=gen) * 0.05 for s in LAYER}
    # 30 layers of distinct copies, so that every pass streams its weights from memory.
    copies = {s: [w.clone() for _ in range(LAYERS)] for s, w in dense.items()}
    packed: dict[str, dict[tuple[int, int], list[tuple[GroupWeight, GroupFormat]]]] = {}
    for name, fmt in FORMATS.items():
        packed[name] = {}
        for rows, cols in LAYER:
            shaped = fmt if fmt.group_size else GroupFormat(fmt.codebook, cols)
            weight = _weight(shaped, rows, cols, gen)
            packed[name][(rows, cols)] = [
                (GroupWeight(*(t if t is None else t.clone() for t in weight)), shaped)
                for _ in range(LAYERS)
            ]

    def rows_of(m: int) -> tuple[list[tuple[int, int, int]], float]:
        layers = LAYERS if m <= 16 else 3
        return [(i, *s) for i in range(layers) for s in LAYER], LAYERS / layers

    def kernels(m: int) -> dict[str, list[Callable[[], object]]]:
        x = {k: torch.randn(m, k, generator=gen) for k in (576, 1536)}
        order, _ = rows_of(m)
        out: dict[str, list[Callable[[], object]]] = {
            "float32 F.linear": [
                lambda i=i, n=n, k=k: F.linear(x[k], copies[(n, k)][i]) for i, n, k in order
            ]
        }
        for name in FORMATS:
            layer = [packed[name][(n, k)][i] for i, n, k in order]
            prep = [(_prepared(w, f), f) for w, f in layer]
            out[f"dgpp {name}"] = [
                lambda w=w, f=f: cpu.group_linear_cpu(x[w.codes.shape[1] * 8 // f.bits], w, f)
                for w, f in layer
            ]
            if name != "e4m3 per channel":  # its scales are float32 already
                out[f"dgpp {name}, float32 scales"] = [
                    lambda w=w, f=f: cpu.group_linear_cpu(x[w.codes.shape[1] * 8 // f.bits], w, f)
                    for w, f in prep
                ]
            if not args.no_twin:
                out[f"twin {name}"] = [
                    lambda w=w, f=f: group_linear_torch(x[w.codes.shape[1] * 8 // f.bits], w, f)
                    for w, f in layer[: len(LAYER) * 3]
                ]
        return out

    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, gemm_rows {cpu.GEMM_ROWS}"
    )
    print("ms per 30-layer pass (ratio to float32 F.linear)")
    print("| kernel | " + " | ".join(f"{m} rows" for m in args.rows) + " |")
    print("|---|" + "---|" * len(args.rows))
    results: dict[str, list[float]] = {}
    for m in args.rows:
        _, scale = rows_of(m)
        for name, calls in kernels(m).items():
            # The twin dequantizes on every call (no streaming effect): 3 layers timed.
            factor = LAYERS / 3 if name.startswith("twin") and m <= 16 else scale
            results.setdefault(name, []).append(_time(calls, args.passes) * factor)
    base = results["float32 F.linear"]
    for name, values in results.items():
        cells = [f"{v:.1f} ({v / b:.2f}x)" for v, b in zip(values, base, strict=True)]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
