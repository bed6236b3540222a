"""Reads a GGUF file (its header with `gguf_header`, memory-mapped): the Hugging Face config its
header describes, and its tensors under Hugging Face names, as raw blocks.

Supported architectures are the decoder families the engine runs (`llama`, `qwen2`, `qwen3`)
and BERT embedding files (`bert`, `gguf_bert`);
tensor types are the GGML block formats of `ggml_blocks`. Anything else is refused before a
weight is read, with the supported list. llama.cpp's converter permutes the rows of Llama's
q/k projections (for its rotary layout); `GgufTensor.rows` undoes it, on whole rows, so
quantized blocks need not be touched.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dgpp.engine.errors import ModelLoadError, UnsupportedModelError
from dgpp.engine.quant.gguf_bert import bert_config, bert_name
from dgpp.engine.quant.gguf_header import GgufHeader
from dgpp.kernels.ggml_blocks import BY_TYPE, FORMATS, BlockFormat, dequantize

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "bert": "BertModel",  # embedding files (`gguf_bert`)
}
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")
# llama.cpp leaves these out of the weights it reads (rotary tables it can recompute).
_SKIPPED = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def hf_name(name: str, arch: str = "llama") -> str | None:
    """The Hugging Face name of a GGUF tensor of `arch`; None for one the engine does not use."""
    if arch == "bert":
        stem, _, suffix = name.rpartition(".")
        match = _BLOCK.fullmatch(stem)
        found = bert_name(match.group(2), match.group(1)) if match else bert_name(stem, None)
        return None if found is None else f"{found}.{suffix}"
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    match = _BLOCK.fullmatch(name)
    if match and match.group(2) in LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{LAYER_NAMES[match.group(2)]}"
    return None


@dataclass(frozen=True)
class GgufTensor:
    """One tensor's raw bytes ([rows, bytes per row] uint8, zero-copy from the file), its block
    format and its PyTorch shape ([out, in] for a weight)."""

    name: str  # the Hugging Face name
    gguf_name: str
    format: BlockFormat
    shape: tuple[int, ...]
    raw: torch.Tensor
    unpermute_heads: int = 0  # undo llama.cpp's q/k row permutation over this many heads

    def rows(self) -> torch.Tensor:
        """The raw rows in Hugging Face order."""
        raw = self.raw.reshape(self.shape[0], -1) if len(self.shape) > 1 else self.raw
        if not self.unpermute_heads:
            return raw
        heads = self.unpermute_heads
        half = self.shape[0] // heads // 2
        return raw.reshape(heads, half, 2, -1).transpose(1, 2).reshape(raw.shape)

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.rows(), self.format, self.shape)


class GgufFile:
    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.reader = GgufHeader(path)  # copy-on-write: writable, never written
        except (ValueError, struct.error, OSError) as err:  # GgufFormatError among them
            raise ModelLoadError(f"cannot read the GGUF file {path}: {err}") from None
        self.arch = str(self.field("general.architecture"))
        if self.arch not in ARCHITECTURES:
            raise UnsupportedModelError(
                f"{path.name}: GGUF architecture {self.arch!r} is not supported; supported: "
                + ", ".join(sorted(ARCHITECTURES))
            )
        self._check_types()

    def field(self, key: str, default: Any = None) -> Any:
        return self.reader.field(key, default)

    def arch_field(self, key: str, default: Any = None) -> Any:
        return self.field(f"{self.arch}.{key}", default)

    def _check_types(self) -> None:
        for tensor in self.reader.tensors:
            if int(tensor.tensor_type) not in BY_TYPE:
                raise ModelLoadError(
                    f"{self.path.name}: tensor {tensor.name} has GGUF type "
                    f"{tensor.tensor_type.name}, which dgpp does not read; supported: "
                    + ", ".join(FORMATS)
                )

    def hf_config(self) -> dict[str, Any]:
        """config.json for this file, as transformers would write it."""
        if self.arch == "bert":
            return bert_config(self)
        heads = int(self.arch_field("attention.head_count"))
        hidden = int(self.arch_field("embedding_length"))
        names = {tensor.name for tensor in self.reader.tensors}
        tokens = self.reader.fields.get("tokenizer.ggml.tokens")  # only its length is needed
        config: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.arch]],
            "model_type": self.arch,
            "hidden_size": hidden,
            "intermediate_size": int(self.arch_field("feed_forward_length")),
            "num_hidden_layers": int(self.arch_field("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self.arch_field("attention.head_count_kv", heads)),
            "head_dim": int(self.arch_field("attention.key_length", hidden // heads)),
            "rms_norm_eps": float(self.arch_field("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self.arch_field("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self.arch_field("context_length", 4096)),
            "vocab_size": int(self.arch_field("vocab_size", tokens.count if tokens else 0)),
            "tie_word_embeddings": "output.weight" not in names,
            "hidden_act": "silu",
            "dtype": "float32",
        }
        if self.arch == "llama":
            config["attention_bias"] = "blk.0.attn_q.bias" in names
        formats = {}
        for tensor in self.reader.tensors:
            name = hf_name(tensor.name)
            if name is not None and name.endswith(".weight") and len(tensor.shape) == 2:
                formats[name.removesuffix(".weight")] = tensor.tensor_type.name
        config["quantization_config"] = {"quant_method": "gguf", "weight_formats": formats}
        for key, field in (("bos_token_id", "bos"), ("eos_token_id", "eos")):
            value = self.field(f"tokenizer.ggml.{field}_token_id")
            if value is not None:
                config[key] = int(value)
        return config

    def tensors(self) -> Iterator[GgufTensor]:
        """The tensors the engine uses, under Hugging Face names."""
        heads = int(self.arch_field("attention.head_count"))
        kv_heads = int(self.arch_field("attention.head_count_kv", heads))
        for tensor in self.reader.tensors:
            name = hf_name(tensor.name, self.arch)
            if name is None:
                if tensor.name in _SKIPPED:
                    continue
                raise ModelLoadError(f"{self.path.name}: unexpected tensor {tensor.name}")
            fmt = BY_TYPE[int(tensor.tensor_type)]
            shape = tuple(int(n) for n in reversed(tensor.shape))
            data: np.ndarray = tensor.data
            expected = int(np.prod(shape)) // fmt.block_size * fmt.type_size
            if data.nbytes != expected:
                raise ModelLoadError(
                    f"{self.path.name}: tensor {tensor.name} holds {data.nbytes} bytes, its "
                    f"shape {shape} at {fmt.name} needs {expected} (a truncated file?)"
                )
            raw = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8).reshape(-1))
            permute = 0
            if self.arch == "llama" and tensor.name.endswith(("attn_q.weight", "attn_k.weight")):
                permute = heads if tensor.name.endswith("attn_q.weight") else kv_heads
            yield GgufTensor(name, tensor.name, fmt, shape, raw, permute)
