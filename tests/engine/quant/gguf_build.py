"""Writes tiny random-weight models as GGUF files, the way llama.cpp's converter lays them out:
the real SmolLM2 tokenizer and chat template copied from the shipped GGUF, Llama q/k rows
permuted, each weight stored in the block format the test asks for. Formats gguf-py can
quantize to are quantized from the float weights; K-quants (gguf-py only reads them) get random
blocks with small scales, so the file, not the float model, defines the weights."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, quants

from dgpp.engine.quant.gguf_file import GLOBAL_NAMES, LAYER_NAMES
from dgpp.kernels.ggml_blocks import FORMATS

ARCH = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
QUANTIZABLE = {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"}
# float16 scale bytes of each K-quant block, and the scale size that keeps weights near 0.1
K_SCALES = {"Q4_K": ((0, 2), (2, 4)), "Q5_K": ((0, 2), (2, 4)), "Q6_K": ((208, 210),)}
K_SCALE_SIZE = {"Q4_K": 1.5e-4, "Q5_K": 8e-5, "Q6_K": 1e-3}
# The engine's own GGUF -> Hugging Face names, inverted: transformers' GGUF loader (the reference)
# reads these files with its own mapping, so a wrong name cannot pass unnoticed.
_LAYER = {hf: gguf for gguf, hf in LAYER_NAMES.items()}
_GLOBAL = {hf: gguf for gguf, hf in GLOBAL_NAMES.items()}


def gguf_name(name: str) -> str:
    if name in _GLOBAL:
        return _GLOBAL[name]
    parts = name.split(".")  # model.layers.N.<rest>
    return f"blk.{parts[2]}.{_LAYER['.'.join(parts[3:])]}"


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order for Llama (what `GgufTensor.rows` undoes)."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _random_k_blocks(name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    fmt = FORMATS[name]
    blocks = rng.integers(0, 256, (rows * cols // fmt.block_size, fmt.type_size), dtype=np.uint8)
    for start, end in K_SCALES[name]:
        scales = (rng.uniform(0.5, 1.0, blocks.shape[0]) * K_SCALE_SIZE[name]).astype(np.float16)
        if name == "Q6_K":
            scales *= rng.choice(np.array([-1, 1], dtype=np.float16), blocks.shape[0])
        blocks[:, start:end] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def _encode(values: np.ndarray, fmt: str, rng: np.random.Generator) -> tuple[np.ndarray, int]:
    qtype = GGMLQuantizationType[fmt]
    if fmt == "F32":
        return values.astype(np.float32), qtype
    if fmt == "F16":
        return values.astype(np.float16), qtype
    if fmt in QUANTIZABLE:
        return quants.quantize(values.astype(np.float32), qtype), qtype
    return _random_k_blocks(fmt, values.shape[0], values.shape[1], rng), qtype


@functools.cache
def _tokenizer_fields(source: Path) -> tuple[tuple[str, Any, GGUFValueType, Any], ...]:
    """The `tokenizer.*` fields of `source`: (key, value, type, item type), read once (gguf-py
    parses SmolLM2's 49,152 tokens and 48,900 merges in seconds)."""
    reader = GGUFReader(str(source))
    fields = []
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            vtype = GGUFValueType(field.types[0])
            sub = GGUFValueType(field.types[1]) if vtype == GGUFValueType.ARRAY else None
            fields.append((key, field.contents(), vtype, sub))
    return tuple(fields)


PER_TOKEN = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores")


def _copy_tokenizer(writer: GGUFWriter, source: Path, vocab_size: int) -> None:
    """`source`'s tokenizer; a model with a smaller vocabulary gets its first `vocab_size`
    tokens and the merges among them (a BPE vocabulary cut this way stays consistent: every
    merge kept makes a kept token of two kept ones). Small files read fast: transformers' GGUF
    reader parses every token of the file three times per model it loads."""
    fields = _tokenizer_fields(source)
    tokens = next(value for key, value, *_ in fields if key == "tokenizer.ggml.tokens")
    cut = vocab_size < len(tokens)
    kept = set(tokens[:vocab_size])
    for key, value, vtype, sub in fields:
        if cut and key in PER_TOKEN:
            value = value[:vocab_size]
        elif cut and key == "tokenizer.ggml.merges":
            value = [m for m in value if _merge_kept(m, kept)]
        writer.add_key_value(key, value, vtype, sub)


def _merge_kept(merge: str, kept: set[str]) -> bool:
    left, _, right = merge.partition(" ")
    return left in kept and right in kept and left + right in kept


def write_gguf(
    model: torch.nn.Module,
    architecture: str,
    out: Path,
    weight_format: str,
    tokenizer_gguf: Path,
    embedding_format: str = "F32",
    seed: int = 0,
) -> Path:
    """`model` (a transformers model) as a GGUF file at `out`: 2-D weights in `weight_format`,
    the embedding (and an untied LM head) in `embedding_format`, norms and biases in F32."""
    config = model.config
    arch = ARCH[architecture]
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(out), arch)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(float(getattr(config, "rope_theta", 10000.0)))
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(1)
    _copy_tokenizer(writer, tokenizer_gguf, config.vocab_size)
    tied = bool(config.tie_word_embeddings)
    for name, param in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        values = param.detach().to(torch.float32).numpy()
        target = gguf_name(name)
        if arch == "llama" and target.endswith(("attn_q.weight", "attn_k.weight")):
            values = _permute(values, heads if "attn_q" in target else kv_heads)
        if values.ndim == 1:
            data, qtype = values.astype(np.float32), GGMLQuantizationType.F32
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            data, qtype = _encode(values, embedding_format, rng)
        else:
            data, qtype = _encode(values, weight_format, rng)
        # uint8 block data: gguf-py reads the shape from the bytes
        writer.add_tensor(target, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
