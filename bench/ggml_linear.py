"""The packed GGML CPU kernel against PyTorch's own CPU matmuls, on the default model's layer
shapes (30 layers of q/k/v, o, gate/up and down, cycled so the weights stream from memory as in
a real decode step) and its LM head, in one run:

    python bench/ggml_linear.py

- dgpp's kernel on Q4_1 and Q8_0 blocks (kernels/cpu/ggml_linear.cpp);
- float32 weights through oneDNN's packed linear (what dgpp uses for float32 checkpoints) and
  plain `F.linear`;
- PyTorch's int4 CPU kernel (`_weight_int4pack_mm_for_cpu`, the int4 path torchao builds on), with
  float32 and with bfloat16 activations, on random int4 codes of the same shapes: speed only,
  its numbers are not Q4_1's.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, quants

from dgpp.kernels.ggml_linear import cpu_extension, ggml_linear_cpu
from dgpp.kernels.linear import pack_onednn

LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate/up, down
SHAPES = LAYER * 30
LM_HEAD = (49152, 576)


def _time(calls: list[Callable[[], object]], repeats: int) -> float:
    for call in calls:
        call()
    started = time.perf_counter()
    for _ in range(repeats):
        for call in calls:
            call()
    return (time.perf_counter() - started) / repeats * 1e3


def _rows(rows: int) -> dict[int, torch.Tensor]:
    return {k: torch.randn(rows, k) for k in (576, 1536)}


def main() -> None:
    assert cpu_extension() is not None, "the GGML CPU kernel did not build"
    rng = np.random.default_rng(0)
    dense = {s: rng.standard_normal(s).astype(np.float32) * 0.05 for s in {*LAYER, LM_HEAD}}
    packed = {
        fmt: {
            s: torch.from_numpy(quants.quantize(dense[s], GGMLQuantizationType[fmt])) for s in dense
        }
        for fmt in ("Q4_1", "Q8_0")
    }
    int4 = {}
    for n, k in dense:
        codes = torch.randint(0, 16, (n, k), dtype=torch.int32)
        weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        scales = torch.randn(k // 32, n, 2, dtype=torch.bfloat16)
        int4[(n, k)] = (weight, scales, scales.float())
    onednn = {s: pack_onednn(torch.from_numpy(w), None) for s, w in dense.items()}
    floats = {s: torch.from_numpy(w) for s, w in dense.items()}

    def kernels(rows: int, shapes: list[tuple[int, int]]) -> dict[str, list[Callable[[], object]]]:
        x = _rows(rows)
        return {
            "dgpp Q4_1": [
                lambda s=s: ggml_linear_cpu(x[s[1]], packed["Q4_1"][s], "Q4_1", s[1])
                for s in shapes
            ],
            "dgpp Q8_0": [
                lambda s=s: ggml_linear_cpu(x[s[1]], packed["Q8_0"][s], "Q8_0", s[1])
                for s in shapes
            ],
            "float32 oneDNN": [lambda s=s: onednn[s](x[s[1]]) for s in shapes],
            "float32 F.linear": [lambda s=s: F.linear(x[s[1]], floats[s]) for s in shapes],
            "int4pack float32": [
                lambda s=s: torch.ops.aten._weight_int4pack_mm_for_cpu(
                    x[s[1]], int4[s][0], 32, int4[s][2]
                )
                for s in shapes
            ],
            "int4pack bf16": [
                lambda s=s: torch.ops.aten._weight_int4pack_mm_for_cpu(
                    x[s[1]].bfloat16(), int4[s][0], 32, int4[s][1]
                )
                for s in shapes
            ],
        }

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; milliseconds")
    print(
        "| kernel | 30 layers, 1 row | 30 layers, 4 rows | 30 layers, 16 rows "
        "| 30 layers, 48 rows | LM head, 1 row | 30 layers, 256 rows |"
    )
    print("|---|---|---|---|---|---|---|")
    results: dict[str, list[float]] = {}
    for rows, shapes, repeats in (
        (1, SHAPES, 10),
        (4, SHAPES, 10),
        (16, SHAPES, 5),  # a batch of decoding streams
        (48, SHAPES, 3),
        (1, [LM_HEAD], 20),
        (256, LAYER * 3, 2),
    ):
        for name, calls in kernels(rows, shapes).items():
            scale = 10.0 if rows == 256 else 1.0  # 3 layers timed, 30 reported
            results.setdefault(name, []).append(_time(calls, repeats) * scale)
    for name, values in results.items():
        print(f"| {name} | " + " | ".join(f"{v:.1f}" for v in values) + " |")


if __name__ == "__main__":
    main()
