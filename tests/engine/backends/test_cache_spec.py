"""Per-layer cache specs and attention backends, shown with a test model of two layer kinds.

`TwoWidthForCausalLM` is defined here, not in `dgpp.engine`: even layers keep two key/value
heads (grouped-query attention), odd layers four (multi-head), so the layers need paged KV
caches of two widths, and the odd layers attend through a second backend this test defines.
Neither needed a change to `model_runner.py`. The reference is transformers: an even layer's
two heads are repeated to four in the transformers copy, which is the same attention.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM as HfLlama

from dgpp.engine import SamplingParams
from dgpp.engine.backends.base import BatchLayout, PagedAttentionBackend
from dgpp.engine.backends.cache_spec import CacheSpec, PagedKVSpec
from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.configuration.engine_config import EngineConfig
from dgpp.engine.configuration.parallel import ParallelContext
from dgpp.engine.engine import LLMEngine
from dgpp.engine.models import registry
from dgpp.engine.models.llama import (
    DecoderAttention,
    DecoderLayer,
    DecoderMLP,
    LlamaForCausalLM,
)
from dgpp.engine.planning.memory_plan import plan_memory
from dgpp.engine.planning.resolved import resolve
from tests.conftest import build_tiny_checkpoint
from tests.engine.parity import hf_greedy

NARROW, WIDE = 2, 4  # key/value heads of even and odd layers
HEAD_DIM = 16  # hidden 64 / 4 heads
NUM_LAYERS = 4


class RecordingBackend:
    """A second backend: the PyTorch one under another name, counting what it is asked."""

    name = "test-recording"

    def __init__(self, inner: PagedAttentionBackend) -> None:
        self.inner = inner
        self.num_prepared = 0
        self.num_forwards = 0

    def prepare(self, layout: BatchLayout) -> Any:
        self.num_prepared += 1
        return self.inner.prepare(layout)

    def forward(self, *args: Any) -> torch.Tensor:
        self.num_forwards += 1
        return self.inner.forward(*args)


class TwoWidthForCausalLM(LlamaForCausalLM):
    backend: RecordingBackend | None = None  # the last one built, for the assertions below

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        max_position: int,
        attention: PagedAttentionBackend,
    ) -> None:
        super().__init__(config, parallel, max_position, attention)
        narrow = replace(config, num_kv_heads=NARROW)
        recording = RecordingBackend(attention)
        TwoWidthForCausalLM.backend = recording
        for index in range(config.num_layers):
            prefix = f"model.layers.{index}"
            mlp = DecoderMLP(config, parallel, f"{prefix}.mlp")
            layer_config, backend = (narrow, attention) if index % 2 == 0 else (config, recording)
            self_attn = DecoderAttention(layer_config, parallel, backend, f"{prefix}.self_attn")
            self.model.layers[index] = DecoderLayer(layer_config, self_attn, mlp)

    @classmethod
    def cache_specs(cls, config: ModelConfig, parallel: ParallelContext) -> list[CacheSpec]:
        return [
            PagedKVSpec(NARROW if index % 2 == 0 else WIDE, config.head_dim)
            for index in range(config.num_layers)
        ]


@pytest.fixture
def two_width(
    tmp_path: Path, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Path, HfLlama]:
    """The dgpp checkpoint (narrow even layers) and the equivalent transformers model."""
    monkeypatch.setitem(registry.MODEL_CLASSES, "TwoWidthForCausalLM", TwoWidthForCausalLM)
    checkpoint = build_tiny_checkpoint(
        tmp_path,
        tokenizer_dir,
        "LlamaForCausalLM",
        num_key_value_heads=WIDE,
        num_hidden_layers=NUM_LAYERS,
    )
    hf = HfLlama.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    weights_file = checkpoint / "model.safetensors"
    weights = load_file(str(weights_file))
    with torch.no_grad():
        for index in range(0, NUM_LAYERS, 2):
            attention = hf.model.layers[index].self_attn
            for name in ("k_proj", "v_proj"):
                projection = getattr(attention, name)
                heads = projection.weight.view(WIDE, HEAD_DIM, -1)
                kept = heads[[0, 2]].clone()  # [NARROW, D, hidden]
                weights[f"model.layers.{index}.self_attn.{name}.weight"] = kept.flatten(0, 1)
                # Query heads 0-1 share kept head 0, heads 2-3 kept head 1, as in GQA.
                projection.weight.copy_(kept.repeat_interleave(2, dim=0).flatten(0, 1))
    save_file(weights, str(weights_file), metadata={"format": "pt"})
    config = (checkpoint / "config.json").read_text()
    (checkpoint / "config.json").write_text(
        config.replace('"LlamaForCausalLM"', '"TwoWidthForCausalLM"')
    )
    return checkpoint, hf


def _engine(checkpoint: Path, **knobs: Any) -> LLMEngine:
    options = {"kv_capacity": 512, "block_size": 4, "prefill_chunk_tokens": 8, **knobs}
    return LLMEngine(resolve(EngineConfig(model=str(checkpoint), **options), checkpoint))


def test_each_layer_kind_gets_its_own_pool_and_the_plan_counts_both(
    two_width: tuple[Path, HfLlama],
) -> None:
    checkpoint, _ = two_width
    engine = _engine(checkpoint)
    pools = engine.runner.kv_caches
    blocks = engine.config.num_kv_blocks
    # One pool per spec, in first-use order; every pool is indexed by the same block ids.
    assert [tuple(pool.shape) for pool in pools] == [
        (NUM_LAYERS // 2, 2, blocks, 4, NARROW, HEAD_DIM),
        (NUM_LAYERS // 2, 2, blocks, 4, WIDE, HEAD_DIM),
    ]
    layers = engine.runner.model.model.layers
    for index, layer in enumerate(layers):
        cache = layer.self_attn.attn.cache
        assert cache is not None and cache.data_ptr() == pools[index % 2][index // 2].data_ptr()
    plan = plan_memory(engine.config, engine.model_config, 1)
    assert plan.kv_bytes == sum(pool.nbytes for pool in pools)
    per_token = NUM_LAYERS // 2 * 2 * (NARROW + WIDE) * HEAD_DIM * 4  # float32
    assert plan.kv_bytes == blocks * 4 * per_token
    assert [backend.name for backend in engine.runner.backends] == ["cpu-paged", "test-recording"]


def test_two_widths_and_two_backends_decode_like_transformers(
    two_width: tuple[Path, HfLlama],
) -> None:
    """Chunked prefill, decode rows and speculative verify rows, with prefix-cache hits, all
    through both pools: greedy tokens equal transformers' on the equivalent model."""
    checkpoint, hf = two_width
    prompts = [list(range(300, 337)), [5, 6, 7, 5, 6, 7, 5, 6], list(range(1000, 1013))]
    prompts.append(prompts[0] + [11, 12])  # starts on the first prompt's cached blocks
    expected = [hf_greedy(hf, prompt, 16) for prompt in prompts]
    for knobs in ({}, {"speculative": "ngram", "spec_ngram_min": 1}):
        engine = _engine(checkpoint, prefix_min_tokens=0, **knobs)
        backend = TwoWidthForCausalLM.backend
        assert backend is not None and backend.num_prepared == 0
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        got: dict[str, list[int]] = {}
        ids = [engine.add_request(prompts[0], params).request_id]
        while engine.has_unfinished():  # the first prompt alone, so the last one can hit
            for output in engine.step():
                got[output.request_id] = list(output.outputs[0].token_ids)
        ids += [engine.add_request(prompt, params).request_id for prompt in prompts[1:]]
        while engine.has_unfinished():
            for output in engine.step():
                got[output.request_id] = list(output.outputs[0].token_ids)
        assert [got[request_id] for request_id in ids] == expected, knobs
        counters = engine.counters
        assert counters.prefix_cache.hits >= 1
        assert (counters.spec_decode.draft_tokens > 0) == bool(knobs)
        # The second backend prepared its metadata once per step; each odd layer used it.
        assert backend.num_prepared == counters.num_steps
        assert backend.num_forwards == backend.num_prepared * (NUM_LAYERS // 2)
