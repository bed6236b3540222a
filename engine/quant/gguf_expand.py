"""A GGUF file expanded into a plain float32 safetensors checkpoint.

The header files are its view's (`gguf_view.write_header_files`: config, tokenizer, chat
template, generation config), with the quantization entry dropped; every tensor is dequantized
by `ggml_blocks` (bit for bit gguf-py's dequantizer) under its Hugging Face name, llama.cpp's
q/k row permutation undone. One read of the header, no model built: transformers' GGUF loader
took 28 s for the 135M default model (its reader parses the 49,152-token vocabulary three
times), this takes about 6 s, most of it the tokenizer's conversion.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from dgpp.engine.quant.gguf_file import GgufFile
from dgpp.engine.quant.gguf_view import write_header_files

WEIGHTS_NAME = "model.safetensors"


def write_float32(gguf: Path, out_dir: Path) -> dict[str, object]:
    """`gguf` as a float32 checkpoint in `out_dir`; returns its config."""
    source = GgufFile(gguf)
    config = write_header_files(source, out_dir)
    config.pop("quantization_config", None)
    config["dtype"] = "float32"
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    weights = {
        tensor.name: tensor.dequantize().to(torch.float32).contiguous()
        for tensor in source.tensors()
    }
    save_file(weights, str(out_dir / WEIGHTS_NAME), metadata={"format": "pt"})
    return config
