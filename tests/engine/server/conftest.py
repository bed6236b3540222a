"""Fixtures: one real server on the default model (SmolLM2-135M-Instruct) for the whole session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.engine.server.harness import RunningServer, running_server

MODEL = "smollm"
ALIAS = "smollm-alias"
MAX_MODEL_LEN = 512
DEFAULT_ENGINE = {"kv_capacity": 2048, "block_size": 16, "max_model_len": MAX_MODEL_LEN}


@pytest.fixture(scope="session")
def server(default_checkpoint: Path) -> Iterator[RunningServer]:
    with running_server(default_checkpoint, (MODEL, ALIAS), DEFAULT_ENGINE) as running:
        yield running


@pytest.fixture
def http(server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60.0) as client:
        yield client


@pytest.fixture
def sdk(server: RunningServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0) as client:
        yield client


@pytest.fixture(scope="session")
def tokenizer(default_checkpoint: Path) -> Any:
    """The default model's real tokenizer and chat template."""
    from dgpp.engine.tokenization.tokenizer import load_tokenizer

    return load_tokenizer(default_checkpoint)
