"""The parity harness (`tests/engine/family_parity.py`) over the vision-language families:
a prompt with two images of different, non-square grids (M-RoPE's positions behind the
sequence index from the first image on), chunked below the prompt, then decode at every step,
cold and after a prefix hit that holds both images."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import tiny_model
from tests.engine.family_parity import Family, Reference, check_family

# Qwen3-VL as issue 62 built it: interleaved M-RoPE in sections of 4/6/6 frequencies.
MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6],
         "mrope_interleaved": True}  # fmt: skip
FAMILIES = [
    Family("qwen3-vl", "Qwen3VLForConditionalGeneration", {"rope_parameters": MROPE}, vision=True),
    Family("qwen3-vl-moe", "Qwen3VLMoeForConditionalGeneration", vision=True),
    Family("qwen3.5-vl", "Qwen3_5ForConditionalGeneration", vision=True),
]


@pytest.mark.parametrize("family", FAMILIES, ids=lambda family: family.name)
def test_vision_family_matches_transformers(
    tmp_path: Path, tokenizer_dir: Path, family: Family
) -> None:
    model = tiny_model(family.architecture, **family.overrides)
    model.save_pretrained(str(tmp_path), safe_serialization=True)
    for item in tokenizer_dir.iterdir():
        (tmp_path / item.name).write_bytes(item.read_bytes())
    check_family(tmp_path, Reference(model, vision=True), family)
