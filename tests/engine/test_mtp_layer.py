"""The multi-token-prediction layer (`engine/models/mtp.py`) of DeepSeek-V3 and GLM-4.5 against
a reference written from the DeepSeek-V3 paper's equations in this test (transformers does not
run MTP layers):

    x_i = M [RMSNorm(Emb(t_{i+1})); RMSNorm(h_i)],   g_i = TRM(x_i),
    logits_i = OutHead(RMSNorm(g_i)),

with transformers' own decoder layer of the family as TRM (causal over the prompt's positions)
and its RMSNorm and rotary embedding. The MTP tensors are random and appended to a tiny
checkpoint as `model.layers.{N}.*`, the way released checkpoints store them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dgpp.engine import LLM
from dgpp.engine.backends.base import BatchLayout, BatchRow
from dgpp.engine.cache_spec import allocate_caches, cache_layers
from dgpp.engine.loader import load_weights
from dgpp.engine.models.mtp import MtpLayer
from dgpp.engine.parallel import ParallelContext
from tests.conftest import build_tiny_checkpoint
from tests.engine.mtp_checkpoint import FAMILIES, hf_class, stacked, with_mtp_layer


def _reference(mtp: dict[str, torch.Tensor], config: object, embed: torch.Tensor, h, next_ids):
    """The paper's MTP step for one sequence of positions 0 .. T-1, causal."""
    index = config.num_hidden_layers
    block = hf_class(config, "DecoderLayer")(config, index).float().eval()
    block.load_state_dict(stacked({k: v for k, v in mtp.items() if not k.startswith(OWN)}))

    def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        norm = hf_class(config, "RMSNorm")(x.shape[-1], eps=config.rms_norm_eps)
        norm.weight.data.copy_(weight)
        return norm(x)

    x = torch.cat((rms(embed[next_ids], mtp["enorm.weight"]), rms(h, mtp["hnorm.weight"])), -1)
    x = x @ mtp["eh_proj.weight"].T
    tokens = x.shape[0]
    positions = torch.arange(tokens)[None]
    rotary = hf_class(config, "RotaryEmbedding")(config)
    cos_sin = rotary(x[None], positions)
    mask = torch.full((tokens, tokens), float("-inf")).triu(1)[None, None]
    with torch.inference_mode():
        g = block(x[None], attention_mask=mask, position_ids=positions, position_embeddings=cos_sin)
    g = g[0] if isinstance(g, tuple) else g
    g = g[0]
    logits = rms(g, mtp["shared_head.norm.weight"]) @ mtp["shared_head.head.weight"].T
    return g, logits


OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_mtp_layer_is_the_papers_step(tmp_path: Path, tokenizer_dir: Path, family: str) -> None:
    architecture, overrides, _, _ = FAMILIES[family]
    checkpoint = build_tiny_checkpoint(
        tmp_path, tokenizer_dir, architecture, num_nextn_predict_layers=1, **overrides
    )
    mtp_tensors, config = with_mtp_layer(checkpoint)
    llm = LLM(str(checkpoint), kv_capacity=256, block_size=16)  # the target skips layer N
    runner = llm.engine.runner
    target, backend = runner.model, runner.backends[0]
    layer = MtpLayer(target, ParallelContext(), backend, config.num_hidden_layers)
    load_weights(layer, checkpoint)  # every parameter from `model.layers.N.*`, or it raises
    allocate_caches(cache_layers(layer), 4, 16, torch.float32, torch.device("cpu"))

    tokens = 21
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(tokens, config.hidden_size, generator=gen)
    next_ids = torch.randint(3, 1000, (tokens,), generator=gen)
    layout = BatchLayout((BatchRow(0, tokens, [2, 0]),), 0, 16, prefill_softmax_fp32=True)
    metadata = {backend.name: backend.prepare(layout)}
    with torch.inference_mode():
        g = layer(h, next_ids, torch.arange(tokens), metadata)
        logits = layer.compute_logits(g)[:, : config.vocab_size]
    embed = target.model.embed_tokens.weight.detach()
    ref_g, ref_logits = _reference(mtp_tensors, config, embed, h, next_ids)
    torch.testing.assert_close(g, ref_g, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
