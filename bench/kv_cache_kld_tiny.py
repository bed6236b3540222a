"""What each KV-cache dtype costs on the cache kinds the default model lacks (issue 65): one MLA
model (DeepSeek-V3's latents) and one hybrid (Qwen3-Next: Gated DeltaNet states beside paged
K/V), tiny random-weight checkpoints with the SmolLM2 tokenizer (tests/conftest.py's), scored
on real text in windows by `dgpp eval kld`'s pieces (bench/perplexity.py), each dtype against
the same engine at `auto`.

For the MLA model it also measures the choice `kernels/latent_quant.py` makes: the rope key
kept in the model dtype (what dgpp serves) against the whole 576-wide row quantized ("rope
quantized too", run by swapping the row format in this process only).

    .venv/bin/python bench/kv_cache_kld_tiny.py [--text FILE] [--tokens 4096] [--context 256]

Random tiny models (tests/conftest.py's weights, normal with std 0.08) predict no text: their
next-token distributions are nearly flat where the text's tokens are concerned (perplexity
above the vocabulary's size), so their KL is orders below a trained model's; the top-token
agreement is the figure that compares dtypes and the two rope choices.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from dgpp.engine.backends import cache_spec, sparse_mla, torch_mla
from dgpp.engine.evaluation.eval_scoring import windows
from dgpp.kernels import latent_quant

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
from perplexity import dgpp_side, kl_cells, reference_of, row, text_arguments, text_tokens

from tests.conftest import build_tiny_checkpoint, smollm2_gguf_dir
from tests.engine.family_cases import MOE_DEEPSEEK

DTYPES = ("int8", "fp8_e4m3", "int4")
MODELS = {
    "deepseek-v3 (MLA)": (
        "DeepseekV3ForCausalLM",
        {**MOE_DEEPSEEK, "num_hidden_layers": 4, "kv_lora_rank": 64, "qk_rope_head_dim": 16},
    ),
    "qwen3-next (hybrid)": ("Qwen3NextForCausalLM", {"mlp_only_layers": [1]}),
}


@contextlib.contextmanager
def rope_quantized() -> Iterator[None]:
    """Latent rows quantized whole, the rope key in the blocks too (the alternative measured)."""
    whole = lambda kv, quantized, kept=0: latent_quant.row_format(kv, quantized + kept, 0)  # noqa: E731
    modules = (cache_spec, torch_mla, sparse_mla)
    saved = [module.row_format for module in modules]
    for module in modules:
        module.row_format = whole
    try:
        yield
    finally:
        for module, original in zip(modules, saved, strict=True):
            module.row_format = original


def tokenizer(folder: Path) -> Path:
    from transformers import AutoTokenizer

    from tests.conftest import GGUF_NAME

    source = smollm2_gguf_dir()
    AutoTokenizer.from_pretrained(str(source), gguf_file=GGUF_NAME).save_pretrained(str(folder))
    return folder


def main() -> None:
    args = text_arguments(__doc__, 4096, 256, 64).parse_args()
    knobs = {"dtype": "float32", "prefix_cache": False}
    print("| model | KV cache | perplexity | KL mean | KL p99 | same top |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        words = tokenizer(Path(tmp) / "tokenizer")
        for name, (architecture, overrides) in MODELS.items():
            checkpoint = build_tiny_checkpoint(Path(tmp) / name, words, architecture, **overrides)
            tokens = text_tokens(checkpoint, args.text, args.tokens)
            spans = windows(len(tokens), args.context, args.context // 2)
            computed = sum(s.end - s.begin for s in spans)
            auto = dgpp_side(checkpoint, tokens, spans, args.top_k, None, **knobs)
            report(name, row("auto", auto, None, computed))
            runs = [(kv, contextlib.nullcontext) for kv in DTYPES]
            if "MLA" in name:
                runs += [(f"{kv}, rope quantized too", rope_quantized) for kv in DTYPES]
            for label, patched in runs:
                with patched():
                    kv = label.split(",")[0]
                    side = dgpp_side(checkpoint, tokens, spans, 0, reference_of(auto),
                                     kv_cache_dtype=kv, **knobs)  # fmt: skip
                report(name, row(label, side, auto, computed))


def report(model: str, r: dict) -> None:
    kl = kl_cells(r, "(reference)")
    print(f"| {model} | {r['name']} | {r['ppl']:.2f} | {kl} |", flush=True)


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
