"""`PagedAttention`'s sliding windows and sinks, end to end, on a test-only model.

`SlidingQwen2ForCausalLM` is defined here, not in `dgpp.engine`: dgpp's Qwen2 with its
`sliding_attention` layers (from `layer_types`) given `PagedAttention(sliding_window=...)`,
optionally with sinks. Without sinks it is exactly transformers' Qwen2 with sliding layers, the
reference; with sinks (which no transformers Llama-family model has) the reference is dgpp's own
cold run. Either way a prefix-cache hit must not change a token: blocks stay whole for sliding
layers, so cached blocks hold every position's keys.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import Qwen2ForCausalLM as HfQwen2

from dgpp.engine import SamplingParams
from dgpp.engine.backends.base import PagedAttentionBackend
from dgpp.engine.backends.torch_paged import TorchPagedAttention
from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.configuration.engine_config import EngineConfig
from dgpp.engine.configuration.parallel import ParallelContext
from dgpp.engine.engine import LLMEngine
from dgpp.engine.errors import ModelLoadError
from dgpp.engine.layers.attention import PagedAttention
from dgpp.engine.layers.head_partition import partition_heads
from dgpp.engine.models import registry
from dgpp.engine.models.llama import LlamaForCausalLM
from dgpp.engine.planning.resolved import resolve
from tests.conftest import build_tiny_checkpoint
from tests.engine.parity import hf_greedy

WINDOW = 5
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]


class SlidingQwen2ForCausalLM(LlamaForCausalLM):
    has_sinks = False  # set by the fixture

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        max_position: int,
        attention: PagedAttentionBackend,
    ) -> None:
        super().__init__(config, parallel, max_position, attention)
        for index, kind in enumerate(LAYER_TYPES):
            attn = self.model.layers[index].self_attn
            old = attn.attn
            heads = attn.qkv_proj.heads
            attn.attn = PagedAttention(
                old.num_heads,
                old.num_kv_heads,
                old.head_dim,
                old.scale,
                attention,
                sliding_window=WINDOW if kind == "sliding_attention" else None,
                has_sinks=self.has_sinks,
                first_head=heads.q_start,
            )


@pytest.fixture(params=[False, True], ids=["no-sinks", "sinks"])
def sliding(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    tokenizer_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[Path, HfQwen2 | None]:
    """The dgpp checkpoint and, without sinks, the transformers model it equals."""
    has_sinks: bool = request.param
    # The checkpoint stays a Qwen2 one (its q/k/v biases follow the name); dgpp serves it with
    # the test model for the test's duration.
    monkeypatch.setitem(registry.MODEL_CLASSES, "Qwen2ForCausalLM", SlidingQwen2ForCausalLM)
    monkeypatch.setattr(SlidingQwen2ForCausalLM, "has_sinks", has_sinks)
    checkpoint = build_tiny_checkpoint(
        tmp_path,
        tokenizer_dir,
        "Qwen2ForCausalLM",
        num_hidden_layers=len(LAYER_TYPES),
        use_sliding_window=True,
        sliding_window=WINDOW,
        layer_types=LAYER_TYPES,
    )
    hf = None
    if not has_sinks:
        hf = HfQwen2.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
        assert hf.model.layers[0].self_attn.sliding_window == WINDOW
        assert hf.model.layers[1].self_attn.sliding_window is None
    else:
        weights_file = checkpoint / "model.safetensors"
        weights = load_file(str(weights_file))
        generator = torch.Generator().manual_seed(3)
        for index in range(len(LAYER_TYPES)):
            sinks = 2 * torch.randn(4, generator=generator)
            weights[f"model.layers.{index}.self_attn.attn.sinks"] = sinks
        save_file(weights, str(weights_file), metadata={"format": "pt"})
    assert json.loads((checkpoint / "config.json").read_text())["layer_types"] == LAYER_TYPES
    return checkpoint, hf


def _engine(checkpoint: Path, **knobs: Any) -> LLMEngine:
    options = {"kv_capacity": 1024, "block_size": 4, "prefill_chunk_tokens": 7, **knobs}
    return LLMEngine(resolve(EngineConfig(model=str(checkpoint), **options), checkpoint))


def _generate(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    ids = [engine.add_request(prompt, params).request_id for prompt in prompts]
    got: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for output in engine.step():
            got[output.request_id] = list(output.outputs[0].token_ids)
    return [got[request_id] for request_id in ids]


def test_prefix_hit_on_sliding_layers_equals_a_cold_run(
    sliding: tuple[Path, HfQwen2 | None],
) -> None:
    """Prompts several windows long in chunks of 7 over blocks of 4, with decode rows and
    speculative verify rows; the later prompts start on the first one's cached blocks."""
    checkpoint, hf = sliding
    first = list(range(300, 337))
    later = [first + [11, 12, 13], first[:22] + [5, 6, 7, 5, 6, 7, 5, 6]]
    new_tokens = 12
    for knobs in ({}, {"speculative": "ngram", "spec_ngram_min": 1}):
        cold = _generate(_engine(checkpoint, prefix_cache=False, **knobs), later, new_tokens)
        engine = _engine(checkpoint, prefix_min_tokens=0, **knobs)
        _generate(engine, [first], new_tokens)  # alone, so the later prompts can hit
        warm = _generate(engine, later, new_tokens)
        assert engine.counters.prefix_cache.hits >= 2, knobs
        assert warm == cold, knobs
        if hf is not None:
            assert cold == [hf_greedy(hf, prompt, new_tokens) for prompt in later], knobs
        if knobs:
            assert engine.counters.spec_decode.draft_tokens > 0


def test_sinks_load_this_ranks_heads() -> None:
    """Query heads are split by key/value group: with 6 heads over 3 groups on two ranks, rank
    0 holds heads 0-3 and rank 1 heads 4-5, and each keeps those heads' sinks."""
    backend = TorchPagedAttention(torch.device("cpu"))
    full = torch.arange(6, dtype=torch.float32)
    for rank, expected in ((0, [0, 1, 2, 3]), (1, [4, 5])):
        heads = partition_heads(6, 3, tp_size=2, tp_rank=rank)
        layer = PagedAttention(
            heads.num_q, heads.num_kv, 8, 1.0, backend, has_sinks=True, first_head=heads.q_start
        )
        assert layer.sinks is not None
        layer.sinks.weight_loader(layer.sinks, full)  # type: ignore[attr-defined]
        assert layer.sinks.tolist() == expected
    with pytest.raises(ModelLoadError, match="attention sinks"):
        layer.sinks.weight_loader(layer.sinks, full[:5])  # type: ignore[attr-defined]


def test_layers_without_options_own_no_parameters() -> None:
    layer = PagedAttention(4, 2, 8, 1.0, TorchPagedAttention(torch.device("cpu")))
    assert layer.sinks is None and layer.sliding_window is None
    assert list(layer.parameters()) == []
    assert isinstance(layer, nn.Module)
    with pytest.raises(ValueError, match="sliding_window"):
        PagedAttention(4, 2, 8, 1.0, layer.backend, sliding_window=0)
