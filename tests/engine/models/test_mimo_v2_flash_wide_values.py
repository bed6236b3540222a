"""MiMo-V2-Flash with value heads wider than its query/key heads (`v_head_dim` > `head_dim`,
which transformers' `MiMoV2FlashConfig` accepts): the full layers' paged cache pads the keys to
the values' width (zeros add nothing to a score), the windowed layers keep keys and values of
their own widths. Greedy tokens and teacher-forced logits equal transformers' in prefill chunks
smaller than the prompts; world 2 (each rank its heads' slice of the values and of `o_proj`)
equals world 1."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from dgpp.engine import LLM
from dgpp.engine.backends.cache_spec import PagedKVSpec
from tests.conftest import build_tiny_checkpoint
from tests.engine.models.test_mimo_v2_flash import TINY, check_specs
from tests.engine.parity import check_batch_matches_transformers

WIDE = {**TINY, "v_head_dim": 64}  # keys and queries stay 48 wide


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("mimo-v2-flash-wide-values")
    return build_tiny_checkpoint(out, tokenizer_dir, "MiMoV2FlashForCausalLM", **WIDE)


def test_wide_values_match_transformers_in_small_chunks(checkpoint: Path) -> None:
    """Prompts of up to 40 tokens in chunks of 7 (over block boundaries, past the window of 6):
    transformers' greedy tokens, and its logits within 1e-3 at every teacher-forced position."""
    hf_model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    assert hf_model.config.v_head_dim == 64 > hf_model.config.head_dim == 48
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 49000, (n,), generator=generator).tolist() for n in (3, 9, 23, 40)]
    llm = LLM(str(checkpoint), block_size=4, prefill_chunk_tokens=7, kv_capacity=2048, seed=0)
    check_batch_matches_transformers(llm, hf_model, prompts, 12)


def test_wide_values_cache_and_state_specs(checkpoint: Path) -> None:
    """The full layers page [keys | values] at the wider (value) width, the windowed layers keep
    48-wide keys and 64-wide values; the layers' own specs are the ones the plan sized."""
    check_specs(checkpoint, page_width=64, value_width=64)
    llm = LLM(str(checkpoint), block_size=4, kv_capacity=256, seed=0)
    model = llm.engine.runner.model  # type: ignore[attr-defined]
    paged = [m.cache_spec for m in model.modules() if type(m).__name__ == "PagedAttention"]
    assert paged == [PagedKVSpec(2, 64)] * 2


def test_wide_values_world_of_two_equals_world_of_one(checkpoint: Path) -> None:
    from tests.engine.distributed.test_tensor_parallel import KNOBS, _check_world_of_two

    _check_world_of_two(checkpoint, KNOBS)
