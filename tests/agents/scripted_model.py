"""A tiny Llama with real weights files, the real SmolLM2 tokenizer and a 64K context, wired so
that it answers "Hi" and then ends its turn (greedy or sampled).

Coding agents send a ~12K-token first request with dozens of tools and sample at temperature
1; a random-weight model would ramble to the end of a 64K context. Here two residual
dimensions carry a two-state machine through every layer untouched (the layers' output
projections write nothing there): the embedding of every token but "Hi" puts 10 on dimension
0, that of "Hi" puts 10 on dimension 1; the final norm keeps only those two dimensions and the
LM head maps dimension 0 to "Hi" and dimension 1 to end-of-turn. Everything else is an ordinary
random-weight checkpoint the engine loads like any other.
"""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from tests.conftest import build_tiny_checkpoint

CONTEXT = 65536
ANSWER = "Hi"
END_OF_TURN = 2  # SmolLM2's <|im_end|>


def build_agent_model(out: Path, tokenizer_dir: Path) -> Path:
    build_tiny_checkpoint(
        out,
        tokenizer_dir,
        "LlamaForCausalLM",
        num_hidden_layers=2,
        max_position_embeddings=CONTEXT,
        tie_word_embeddings=False,
    )
    (answer,) = AutoTokenizer.from_pretrained(str(out))(ANSWER, add_special_tokens=False).input_ids
    path = out / "model.safetensors"
    weights = load_file(str(path))
    embed = weights["model.embed_tokens.weight"]
    embed[:, 0], embed[:, 1] = 10.0, 0.0
    embed[answer, 0], embed[answer, 1] = 0.0, 10.0
    for name, weight in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weight[:2, :] = 0.0
    norm = weights["model.norm.weight"]
    norm.zero_()
    norm[:2] = 1.0
    head = weights["lm_head.weight"]
    head.zero_()
    head[answer, 0] = 10.0
    head[END_OF_TURN, 1] = 10.0
    save_file(weights, str(path), metadata={"format": "pt"})
    return out
