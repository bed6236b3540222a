"""Tiny random encoder checkpoints (BERT, XLM-RoBERTa) with a real WordPiece tokenizer built
in the test (BERT's normalizer, pre-tokenizer and [CLS]/[SEP] pair template), and
sentence-transformers' module files where a test asks for its pooling."""

from __future__ import annotations

import json
from pathlib import Path

import torch

TEXT = (
    "the a of to and is in it that for on with as was be by this are or what how why where "
    "code python function file test class return import error value list string number data "
    "query document search find read write cache model server request token"
)
WORDS = TEXT.split(" ")
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def wordpiece_tokenizer(out: Path) -> dict[str, int]:
    """Save a BERT-style fast tokenizer into `out`; returns its vocabulary."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import BertTokenizerFast

    letters = [chr(c) for c in range(97, 123)] + [str(d) for d in range(10)]
    pieces = SPECIAL + letters + ["##" + c for c in letters] + WORDS + [".", ",", "?", "(", ")"]
    vocab = {word: index for index, word in enumerate(dict.fromkeys(pieces))}
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    cls, sep = ("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[cls, sep]
    )
    fast = BertTokenizerFast(tokenizer_object=tokenizer, do_lower_case=True)
    fast.save_pretrained(str(out))
    return vocab


def tiny_encoder(
    out: Path,
    architecture: str,
    seed: int = 0,
    labels: int = 1,
    pooling: str | None = None,
    **shape: int,
) -> torch.nn.Module:
    """A random `architecture` (transformers) saved with the tokenizer into `out`; `pooling`
    ("cls", "mean" or "last") writes sentence-transformers' modules (pooling, then Normalize);
    `shape` overrides the tiny sizes (hidden_size, num_hidden_layers, ...)."""
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    vocab = wordpiece_tokenizer(out)
    roberta = architecture.startswith("XLMRoberta")
    settings = dict(
        vocab_size=len(vocab) + 7, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=66 if roberta else 64, num_labels=labels,
        type_vocab_size=1 if roberta else 2, pad_token_id=vocab["[PAD]"] if not roberta else 1,
    ) | shape  # fmt: skip
    config_class = transformers.XLMRobertaConfig if roberta else transformers.BertConfig
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config_class(**settings)).eval()
    for name, param in model.named_parameters():  # LayerNorms and biases off their defaults
        if "LayerNorm" in name or name.endswith("bias"):
            param.data.normal_(0.0 if name.endswith("bias") else 1.0, 0.2)
    model.save_pretrained(str(out), safe_serialization=True)
    if pooling is not None:
        modes = (("cls", "cls_token"), ("mean", "mean_tokens"), ("last", "lasttoken"))
        flags = {f"pooling_mode_{mode}": pooling == key for key, mode in modes}
        (out / "1_Pooling").mkdir()
        (out / "1_Pooling" / "config.json").write_text(
            json.dumps({"word_embedding_dimension": settings["hidden_size"], **flags})
        )
        modules = [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling",
             "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize",
             "type": "sentence_transformers.models.Normalize"},
        ]  # fmt: skip
        (out / "modules.json").write_text(json.dumps(modules))
    return model


# Hugging Face's BertModel names -> llama.cpp's (its converter's `bert` mapping)
_GGUF_NAMES = (
    ("embeddings.word_embeddings", "token_embd"),
    ("embeddings.position_embeddings", "position_embd"),
    ("embeddings.token_type_embeddings", "token_types"),
    ("embeddings.LayerNorm", "token_embd_norm"),
    ("attention.self.query", "attn_q"),
    ("attention.self.key", "attn_k"),
    ("attention.self.value", "attn_v"),
    ("attention.output.dense", "attn_output"),
    ("attention.output.LayerNorm", "attn_output_norm"),
    ("intermediate.dense", "ffn_up"),
    ("output.dense", "ffn_down"),
    ("output.LayerNorm", "layer_output_norm"),
)


def write_bert_gguf(model: torch.nn.Module, vocab: dict[str, int], out: Path, pooling: int) -> Path:
    """`model` (a transformers BertModel) as llama.cpp's converter writes a BERT embedding GGUF:
    its `bert.*` keys, the WordPiece vocabulary with "▁" marking a word's first piece, [CLS] as
    BOS and [SEP] as the separator, `bert.pooling_type` (1 mean, 2 CLS), weights in F16, norms,
    biases and embeddings in F32."""
    import numpy as np
    from gguf import GGUFWriter, PoolingType

    config = model.config
    writer = GGUFWriter(str(out), "bert")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_layer_norm_eps(config.layer_norm_eps)
    writer.add_causal_attention(False)
    writer.add_pooling_type(PoolingType(pooling))
    writer.add_token_type_count(config.type_vocab_size)
    writer.add_file_type(1)
    tokens = sorted(vocab, key=vocab.__getitem__)
    tokens += [f"[unused{n}]" for n in range(config.vocab_size - len(tokens))]  # the model's rows
    converted = [t if t.startswith("[") else t[2:] if t.startswith("##") else "\u2581" + t
                 for t in tokens]  # fmt: skip
    writer.add_tokenizer_model("bert")
    writer.add_token_list(converted)
    writer.add_token_types([3 if t.startswith("[") else 1 for t in tokens])
    writer.add_bos_token_id(vocab["[CLS]"])
    writer.add_sep_token_id(vocab["[SEP]"])
    writer.add_unk_token_id(vocab["[UNK]"])
    writer.add_pad_token_id(vocab["[PAD]"])
    for name, param in model.state_dict().items():
        if name.startswith("pooler.") or name.endswith("position_ids"):
            continue
        stem, _, suffix = name.rpartition(".")
        layer = None
        if stem.startswith("encoder.layer."):
            layer, _, stem = stem.removeprefix("encoder.layer.").partition(".")
        target = dict(_GGUF_NAMES)[stem]
        target = f"blk.{layer}.{target}.{suffix}" if layer is not None else f"{target}.{suffix}"
        values = param.detach().float().numpy()
        if values.ndim == 2 and not stem.startswith("embeddings."):
            values = values.astype(np.float16)
        writer.add_tensor(target, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
