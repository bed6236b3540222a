"""BERT embedding files as llama.cpp writes and serves them (`general.architecture: bert`: the
bge, MiniLM and nomic-style GGUFs that `llama-server --embeddings` takes), read as a `BertModel`
checkpoint (`models.bert`): its config, its tensors under Hugging Face names, its WordPiece
tokenizer and its pooling.

llama.cpp's converter stores the WordPiece vocabulary with a word's first piece marked by a
leading "▁" and continuation pieces bare (where Hugging Face writes "##"); special tokens
("[CLS]") stay as they are. `wordpiece_vocabulary` turns that back. Its tokenizer lowercases
(llama.cpp's WPM does), so a cased BERT's GGUF reads lowercased, as llama.cpp reads it.
`bert.pooling_type` becomes sentence-transformers' pooling files beside the config (mean, CLS
or last token; llama.cpp's numbering: 1, 2, 3)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dgpp.engine.errors import ModelLoadError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

    from dgpp.engine.quant.gguf_file import GgufFile

BERT_LAYER_NAMES = {
    "attn_q": "attention.self.query",
    "attn_k": "attention.self.key",
    "attn_v": "attention.self.value",
    "attn_output": "attention.output.dense",
    "attn_output_norm": "attention.output.LayerNorm",
    "ffn_up": "intermediate.dense",
    "ffn_down": "output.dense",
    "layer_output_norm": "output.LayerNorm",
}
BERT_GLOBAL_NAMES = {
    "token_embd": "embeddings.word_embeddings",
    "position_embd": "embeddings.position_embeddings",
    "token_types": "embeddings.token_type_embeddings",
    "token_embd_norm": "embeddings.LayerNorm",
}
POOLING = {1: "mean", 2: "cls", 3: "last"}  # llama.cpp's LLAMA_POOLING_TYPE_*
_WORD_START = "\u2581"


def bert_name(stem: str, layer: str | None) -> str | None:
    """The Hugging Face name of a BERT GGUF tensor (`stem`: its name without .weight/.bias, of
    block `layer`, or global), without its suffix; None for one the encoder does not use."""
    if layer is None:
        return BERT_GLOBAL_NAMES.get(stem)
    part = BERT_LAYER_NAMES.get(stem)
    return None if part is None else f"encoder.layer.{layer}.{part}"


def bert_config(source: GgufFile) -> dict[str, Any]:
    """config.json of a BERT GGUF, as transformers writes a `BertModel`'s."""
    types = next((t for t in source.reader.tensors if t.name == "token_types.weight"), None)
    tokens = source.reader.fields.get("tokenizer.ggml.tokens")
    return {
        "architectures": ["BertModel"],
        "model_type": "bert",
        "hidden_size": int(source.arch_field("embedding_length")),
        "intermediate_size": int(source.arch_field("feed_forward_length")),
        "num_hidden_layers": int(source.arch_field("block_count")),
        "num_attention_heads": int(source.arch_field("attention.head_count")),
        "max_position_embeddings": int(source.arch_field("context_length", 512)),
        "layer_norm_eps": float(source.arch_field("attention.layer_norm_epsilon", 1e-12)),
        "type_vocab_size": int(types.shape[-1]) if types is not None else 2,
        "vocab_size": int(tokens.count) if tokens is not None else 0,
        "hidden_act": "gelu",
        "pad_token_id": int(source.field("tokenizer.ggml.padding_token_id", 0)),
        "dtype": "float32",
    }


def wordpiece_vocabulary(tokens: list[str]) -> dict[str, int]:
    """Hugging Face's WordPiece vocabulary from llama.cpp's tokens ("▁word" a word's first
    piece, "piece" a continuation, "[X]" special)."""
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        if token.startswith(_WORD_START):
            word = token[len(_WORD_START) :]
        elif token.startswith("[") and token.endswith("]"):
            word = token
        else:
            word = "##" + token
        vocab.setdefault(word, index)
    return vocab


def bert_tokenizer(source: GgufFile) -> PreTrainedTokenizerFast:
    """The file's WordPiece tokenizer, with BERT's normalizer, pre-tokenizer and template."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import BertTokenizerFast

    tokens = [str(t) for t in source.field("tokenizer.ggml.tokens") or []]
    vocab = wordpiece_vocabulary(tokens)

    def special(key: str, default: str) -> str:
        found = source.field(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(found)] if found is not None and int(found) < len(tokens) else default

    cls, sep = special("bos", "[CLS]"), special("seperator", "[SEP]")  # llama.cpp's names
    unk, pad = special("unknown", "[UNK]"), special("padding", "[PAD]")
    if cls not in vocab or sep not in vocab:
        raise ModelLoadError(f"{source.path.name}: its vocabulary lacks {cls} or {sep}")
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token=unk))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}",
        pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, vocab[cls]), (sep, vocab[sep])],
    )
    return BertTokenizerFast(
        tokenizer_object=tokenizer, cls_token=cls, sep_token=sep, unk_token=unk, pad_token=pad
    )


def write_bert_pooling(source: GgufFile, out_dir: Path) -> None:
    """sentence-transformers' pooling files for the file's `bert.pooling_type` (none for a type
    dgpp does not pool by, so the encoder's default, CLS, applies)."""
    mode = POOLING.get(int(source.arch_field("pooling_type", 0)))
    if mode is None:
        return
    flags = {f"pooling_mode_{name}": mode == key for key, name in
             (("cls", "cls_token"), ("mean", "mean_tokens"), ("last", "lasttoken"))}  # fmt: skip
    (out_dir / "1_Pooling").mkdir(exist_ok=True)
    (out_dir / "1_Pooling" / "config.json").write_text(json.dumps(flags, indent=2) + "\n")
