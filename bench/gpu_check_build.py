"""Random-weight checkpoints for the GPU check, built where they run: no download, no gguf.

A transformers model is built on the meta device, its parameters drawn on the target device
(seeded) and saved by transformers beside a word-level tokenizer (`t0 .. tN`), so `LLM(path)`
and transformers both load the same weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

TINY_LLAMA = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=256, max_position_embeddings=512,
)  # fmt: skip
TINY_MOE = dict(
    hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
    vocab_size=256, max_position_embeddings=512, head_dim=16,
)  # fmt: skip
# Qwen3-Next: Gated DeltaNet layers with a gated full-attention layer of every four, MoE with
# a gated shared expert.
TINY_QWEN3_NEXT = dict(
    TINY_MOE, num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
    shared_expert_intermediate_size=32, full_attention_interval=4,
)  # fmt: skip
# 1.45B parameters in Llama's shape (TinyLlama-like widths, 30 layers, a 32K vocabulary).
DECODE_LLAMA = dict(
    hidden_size=2048, intermediate_size=5632, num_hidden_layers=30, num_attention_heads=32,
    num_key_value_heads=4, vocab_size=32000, max_position_embeddings=40960,
)  # fmt: skip
DRY_DECODE_LLAMA = dict(TINY_LLAMA, max_position_embeddings=2048)


def _config(architecture: str, sizes: dict[str, Any]) -> Any:
    from transformers import DeepseekV3Config, LlamaConfig, Qwen3MoeConfig, Qwen3NextConfig

    config_class = {
        "DeepseekV3ForCausalLM": DeepseekV3Config,
        "LlamaForCausalLM": LlamaConfig,
        "Qwen3MoeForCausalLM": Qwen3MoeConfig,
        "Qwen3NextForCausalLM": Qwen3NextConfig,
    }
    config = config_class[architecture](
        **sizes, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False
    )
    config.architectures = [architecture]
    return config


def _write_tokenizer(out: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, "t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(out / "tokenizer.json"))
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "t0", "eos_token": "t1"}
    (out / "tokenizer_config.json").write_text(json.dumps(settings))


def random_checkpoint(
    out: Path, architecture: str, sizes: dict[str, Any], device: torch.device, seed: int = 0
) -> Path:
    """A checkpoint of `architecture` with `sizes`, its weights drawn on `device` (bfloat16
    for a large model, float32 for a small one) and saved into `out` by transformers (in the
    Hub's layout, as a released checkpoint is)."""
    from transformers import AutoModelForCausalLM

    config = _config(architecture, sizes)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    big = sum(p.numel() for p in model.parameters()) > 100_000_000
    dtype = torch.bfloat16 if big else torch.float32
    model = model.to_empty(device=device).to(dtype)
    gen = torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # saved, left unset by to_empty
                buffer.zero_()
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen, device=device)
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * noise)
            else:
                param.copy_(0.02 * noise)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    _write_tokenizer(out, config.vocab_size)
    return out
