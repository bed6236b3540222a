"""An fp8 KV cache at a checkpoint's static scales against fp8 at a scale per row (issue 65):
what a calibrated `k_scale`/`v_scale` (ModelOpt, compressed-tensors) costs beside dgpp's own
per-row scales, on the default model's shipped file:

    .venv/bin/python bench/kv_static_scales.py [--text FILE] [--tokens 8192] [--context 256]

The static scales are calibrated as the producers do it, on text the score never sees: each
paged layer's largest |key| (after RoPE) and |value| over the text's first `--calibration`
tokens, over 448; the score runs on the tokens after them. Each run's KL is against the
model-dtype cache over its top K tokens and one bucket for the rest (bench/perplexity.py's).
Prints a markdown table; docs/quality.md records it."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from dgpp.appliance.models.default import install_default
from dgpp.engine.evaluation.eval_scoring import Collector, score_text, windows
from dgpp.engine.layers.attention import PagedAttention
from dgpp.kernels.rope_store_torch import apply_rotary

sys.path.insert(0, str(Path(__file__).parent))
from perplexity import dgpp_side, kl_cells, reference_of, row, text_arguments, text_tokens


def calibrated(tokens: list[int], context: int):
    """A `prepare` that gives every paged layer static scales from `tokens`' keys and values."""

    def prepare(llm) -> None:
        layers = [m for m in llm.engine.runner.model.modules() if type(m) is PagedAttention]
        peaks = {id(layer): [0.0, 0.0] for layer in layers}

        def record(layer, args) -> None:
            _query, key, value, _metadata, *rest = args
            angles = rest[0] if rest else None
            if angles is not None:  # a backend that fuses RoPE gets the key unrotated
                key = apply_rotary(key, angles)
            peak = peaks[id(layer)]
            peak[0] = max(peak[0], float(key.abs().max()))
            peak[1] = max(peak[1], float(value.abs().max()))

        hooks = [layer.register_forward_pre_hook(record) for layer in layers]
        spans = windows(len(tokens), context, context - 1)
        score_text(llm.engine, Collector(tokens, 0, None), spans)
        for hook in hooks:
            hook.remove()
        for layer in layers:
            layer.register_buffer("kv_scale", torch.tensor(peaks[id(layer)]) / 448.0)
            layer.static_kv = True

    return prepare


def main() -> None:
    parser = text_arguments(__doc__, 8192, 256, 128)
    parser.add_argument("--calibration", type=int, default=2048)
    args = parser.parse_args()
    shipped = install_default() / "model.gguf"
    every = text_tokens(shipped, args.text, args.calibration + args.tokens)
    calibration, tokens = every[: args.calibration], every[args.calibration :]
    spans = windows(len(tokens), args.context, args.context // 2)
    computed = sum(s.end - s.begin for s in spans)
    knobs = {"native_decode": False}
    ours = dgpp_side(shipped, tokens, spans, args.top_k, None, kv_cache_dtype="auto", **knobs)
    rows = [row("dgpp auto", ours, None, computed)]
    runs = {
        "fp8_e4m3, a scale per row": None,
        "fp8_e4m3, static calibrated scales": calibrated(calibration, args.context),
    }
    for name, prepare in runs.items():
        print(f"dgpp {name} ...", file=sys.stderr)
        side = dgpp_side(shipped, tokens, spans, args.top_k, reference_of(ours), prepare,
                         kv_cache_dtype="fp8_e4m3", **knobs)  # fmt: skip
        rows.append(row(f"dgpp {name}", side, ours, computed))
    print(f"{args.text.name}: {len(tokens):,} tokens after {len(calibration):,} of calibration, "
          f"windows of {args.context} every {args.context // 2}; KL against the model-dtype "
          f"cache over its top {args.top_k} + the rest")  # fmt: skip
    print("| KV cache | perplexity (95% interval) | KL mean | KL p99 | same top |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {r['ppl']:.4f} ({r['ppl_low']:.3f} to {r['ppl_high']:.3f}) | "
              f"{kl_cells(r, '(reference)')} |")  # fmt: skip


if __name__ == "__main__":
    main()
