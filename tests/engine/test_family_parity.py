"""The parity harness (`family_parity`) over the text families: dense, MoE, MLA, DSA,
DeepSeek-V4, windowed, QSA and hybrid (the vision-language ones:
tests/engine/vision/test_vl_family_parity.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.conftest import build_tiny_checkpoint
from tests.engine.family_cases import DENSE, HYBRID, LATENT, MOE, WINDOWED_AND_SPARSE
from tests.engine.family_parity import Family, Reference, check_family

FAMILIES = [*DENSE, *MOE, *LATENT, *WINDOWED_AND_SPARSE, *HYBRID]


@pytest.mark.parametrize("family", FAMILIES, ids=lambda family: family.name)
def test_family_matches_transformers(tmp_path: Path, tokenizer_dir: Path, family: Family) -> None:
    check_text_family(tmp_path, tokenizer_dir, family)


def check_text_family(tmp_path: Path, tokenizer_dir: Path, family: Family) -> None:
    """The harness on a text family: its checkpoint, transformers and one engine."""
    checkpoint = build_tiny_checkpoint(
        tmp_path, tokenizer_dir, family.architecture, **family.overrides
    )
    hf_model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    check_family(checkpoint, Reference(hf_model, vision=False), family)
