"""dgpp's GGUF header reader (engine/quant/gguf_header.py) reads what gguf-py's GGUFReader reads:
every metadata value and every tensor's name, type, shape and bytes, on the tokenizer_gguf SmolLM2
file and on a tiny file of every block format; broken files are refused with where they break."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from dgpp.engine.quant.gguf_header import GgufFormatError, GgufHeader
from tests.conftest import tiny_model
from tests.engine.quant.gguf_build import write_gguf


def _same_as_gguf_py(path: Path) -> None:
    ours, theirs = GgufHeader(path), GGUFReader(str(path))
    pseudo = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}
    assert set(ours.fields) == set(theirs.fields) - pseudo
    for key, field in theirs.fields.items():
        if key not in pseudo:
            expected = field.contents()
            got = ours.field(key)
            assert (
                got == pytest.approx(expected) if isinstance(expected, float) else got == expected
            ), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, ref in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.tensor_type == ref.tensor_type, mine.name
        assert mine.shape == tuple(int(n) for n in ref.shape), mine.name
        assert np.array_equal(mine.data, np.ascontiguousarray(ref.data).view(np.uint8).reshape(-1))


def test_the_shipped_file_reads_as_gguf_py_reads_it(tokenizer_gguf: Path) -> None:
    _same_as_gguf_py(tokenizer_gguf)


# Block sizes 1, 32 and 256 (the other formats add nothing the header reader does differently);
# the shipped file above carries the whole vocabulary, these its first 4,096 tokens.
@pytest.mark.parametrize("weight_format", ["F32", "BF16", "Q8_0", "Q6_K"])
def test_a_tiny_file_of_each_format_reads_as_gguf_py_reads_it(
    tmp_path: Path, tokenizer_gguf: Path, weight_format: str
) -> None:
    wide = {"hidden_size": 256, "intermediate_size": 512} if "_K" in weight_format else {}
    model = tiny_model("LlamaForCausalLM", 0, vocab_size=4096, **wide)
    path = write_gguf(model, "LlamaForCausalLM", tmp_path / "t.gguf", weight_format, tokenizer_gguf)
    _same_as_gguf_py(path)


def test_broken_files_are_refused_saying_where(tmp_path: Path, tokenizer_gguf: Path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(GgufFormatError, match="no GGUF magic"):
        GgufHeader(junk)
    head = tmp_path / "head.gguf"
    head.write_bytes(tokenizer_gguf.read_bytes()[:200_000])  # cut inside the vocabulary
    with pytest.raises(GgufFormatError, match="past the end of the file"):
        GgufHeader(head)
    tail = tmp_path / "tail.gguf"
    tail.write_bytes(tokenizer_gguf.read_bytes()[:-5000])  # cut inside the last tensor
    with pytest.raises(
        GgufFormatError, match=r"tensor blk\.\S+ \(Q4_1, \d+ bytes\) ends \d+ bytes past the end"
    ):
        GgufHeader(tail)
