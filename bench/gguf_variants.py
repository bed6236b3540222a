"""The default model's GGUF in other formats, for bench/gguf_decode.py: every 2-D weight of the
shipped Q4_1 file dequantized with gguf-py and written again as Q8_0, F16 or F32 (gguf-py's own
quantizer), the norms and every metadata field (tokenizer, chat template, hyperparameters)
copied as they are. Both engines then read the same file of each format. Cached beside the
bench's other files (`~/.cache/dgpp/bench`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType, quants

from dgpp.kernels.cache_dir import dgpp_cache_dir

FILE_TYPES = {"F32": LlamaFileType.ALL_F32, "F16": LlamaFileType.MOSTLY_F16}
FILE_TYPES["Q8_0"] = LlamaFileType.MOSTLY_Q8_0


def variant(source: Path, fmt: str) -> Path:
    """`source` with its 2-D weights in `fmt` (Q8_0, F16 or F32); written once."""
    out = dgpp_cache_dir() / "bench" / f"{source.parent.name}-{fmt}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    reader = GGUFReader(str(source))
    arch = str(reader.fields["general.architecture"].contents())
    partial = out.with_suffix(".partial")
    writer = GGUFWriter(str(partial), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        vtype = GGUFValueType(field.types[0])
        sub = GGUFValueType(field.types[1]) if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub)
    writer.add_file_type(FILE_TYPES[fmt])
    qtype = GGMLQuantizationType[fmt]
    for tensor in reader.tensors:
        values = quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        if values.ndim != 2 or fmt == "F32":  # norms stay float32
            writer.add_tensor(tensor.name, values)
        elif fmt == "F16":
            writer.add_tensor(tensor.name, values.astype(np.float16))
        else:
            writer.add_tensor(tensor.name, quants.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.rename(out)
    return out
