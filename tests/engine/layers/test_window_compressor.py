"""DeepSeek-V4's compressors against transformers' modules with the same random weights: the
heavily compressed keys (windows of their own tokens) and the compressed sparse keys (each window
with the previous window's first half), fed as a whole sequence and in chunks that split
windows (prefill pieces, then one token at a time) with transformers' own caches; every key equal
and emitted on the same step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as reference

from dgpp.engine.checkpoint.config import parse_rope
from dgpp.engine.layers.rotary import RotaryEmbedding
from dgpp.engine.layers.window_compressor import WindowCompressor

HIDDEN, DIM, ROPE = 32, 16, 8
CHUNKS = (5, 12, 1, 1, 4, 12, 1, 1, 1)  # 38 tokens: windows closed mid-chunk and by decode steps
V4 = reference
KINDS = {
    "hca": ("heavily_compressed_attention", V4.DeepseekV4HCACompressor, V4.DeepseekV4HCACache, 8),
    "csa": ("compressed_sparse_attention", V4.DeepseekV4CSACompressor, V4.DeepseekV4CSACache, 4),
}


def _config(kind: str) -> DeepseekV4Config:
    layer_type = KINDS[kind][0]
    return DeepseekV4Config(
        hidden_size=HIDDEN, head_dim=DIM, qk_rope_head_dim=ROPE, num_attention_heads=2,
        q_lora_rank=16, index_n_heads=2, index_head_dim=16, index_topk=4, num_hidden_layers=1,
        layer_types=[layer_type], max_position_embeddings=256,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        sliding_window=8,
    )  # fmt: skip


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_keys_equal_transformers_whole_and_chunked(kind: str) -> None:
    _, module_class, cache_class, rate = KINDS[kind]
    config = _config(kind)
    theirs = module_class(config).float()
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in theirs.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    ours = WindowCompressor(HIDDEN, DIM, rate, kind == "csa", config.rms_norm_eps)
    state = {k: v for k, v in theirs.state_dict().items() if not k.startswith("indexer.")}
    ours.load_state_dict(state, strict=False)
    assert all(
        torch.equal(ours.state_dict()[k], v) for k, v in state.items() if "inv_freq" not in k
    )
    rotary = RotaryEmbedding(
        ROPE, 256, parse_rope({"rope_parameters": config.rope_parameters["compress"]})
    )
    hidden = torch.randn(1, sum(CHUNKS), HIDDEN, generator=generator)
    q_residual = torch.randn(1, sum(CHUNKS), 16, generator=generator)
    cache = SimpleNamespace(layers=[cache_class(config)])
    carry = ours.empty_carry(hidden[0])
    start, keys = 0, []
    for size in CHUNKS:
        span = slice(start, start + size)
        positions = torch.arange(start, start + size)[None]
        want, _ = theirs(hidden[:, span], q_residual[:, span], positions, cache, 0)
        got, carry = ours.compress(hidden[0, span], carry, rotary)
        keys.append(got)
        emitted = torch.cat(keys)
        assert emitted.shape[0] == (start + size) // rate == carry.windows
        torch.testing.assert_close(emitted, want[0, 0], rtol=1e-5, atol=1e-5)
        start += size
    whole, _ = ours.compress(hidden[0], ours.empty_carry(hidden[0]), rotary)
    torch.testing.assert_close(whole, torch.cat(keys), rtol=1e-5, atol=1e-5)


def test_the_indexer_chooses_as_transformers() -> None:
    """The indexer's keys and each query's chosen keys (as a set) over chunked steps."""
    from dgpp.engine.layers.v4_indexer import LightningIndexer

    config = _config("csa")
    config.index_n_heads, config.index_head_dim, config.index_topk = 8, 16, 3
    theirs = reference.DeepseekV4Indexer(config).float()
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for param in theirs.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    ours = LightningIndexer(HIDDEN, 16, 8, 16, 4, 3, config.rms_norm_eps)
    missing, unexpected = ours.load_state_dict(theirs.state_dict(), strict=False)
    assert not missing and all("inv_freq" in name for name in unexpected)
    rotary = RotaryEmbedding(
        ROPE, 256, parse_rope({"rope_parameters": config.rope_parameters["compress"]})
    )
    hidden = torch.randn(1, sum(CHUNKS), HIDDEN, generator=generator)
    q_latent = torch.randn(1, sum(CHUNKS), 16, generator=generator)
    cache = SimpleNamespace(layers=[reference.DeepseekV4CSACache(config)])
    carry, keys, start = ours.empty_carry(hidden[0]), [], 0
    for size in CHUNKS:
        span, positions = slice(start, start + size), torch.arange(start, start + size)
        want = theirs(hidden[:, span], q_latent[:, span], positions[None], cache, 0)[0]
        got_keys, carry = ours.compress(hidden[0, span], carry, rotary)
        keys.append(got_keys)
        score = ours.scores(hidden[0, span], q_latent[0, span], positions, torch.cat(keys), rotary)
        got = ours.select(score, positions)
        assert got.shape == want.shape
        for row_got, row_want in zip(got.tolist(), want.tolist(), strict=True):
            assert sorted(row_got) == sorted(row_want)
        start += size
    assert sum(k.shape[0] for k in keys) == sum(CHUNKS) // 4
