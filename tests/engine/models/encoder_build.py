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
    out: Path, architecture: str, seed: int = 0, labels: int = 1, pooling: str | None = None
) -> torch.nn.Module:
    """A random `architecture` (transformers) saved with the tokenizer into `out`; `pooling`
    ("cls", "mean" or "last") writes sentence-transformers' modules (pooling, then Normalize)."""
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    vocab = wordpiece_tokenizer(out)
    roberta = architecture.startswith("XLMRoberta")
    settings = dict(
        vocab_size=len(vocab) + 7, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=66 if roberta else 64, num_labels=labels,
        type_vocab_size=1 if roberta else 2, pad_token_id=vocab["[PAD]"] if not roberta else 1,
    )  # fmt: skip
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
            json.dumps({"word_embedding_dimension": 64, **flags})
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
