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

from tests.conftest import build_tiny_checkpoint
from tests.engine.speculative.mtp_checkpoint import FAMILIES, hf_class, stacked, with_mtp_layer
from tests.engine.speculative.mtp_checks import mtp_step


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
    step = mtp_step(checkpoint, config)  # every parameter from `model.layers.N.*`
    embed = step.target.model.embed_tokens.weight.detach()
    ref_g, ref_logits = _reference(mtp_tensors, config, embed, step.h, step.next_ids)
    torch.testing.assert_close(step.g, ref_g, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(step.logits, ref_logits, rtol=1e-4, atol=1e-4)
