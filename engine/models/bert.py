"""Encoder-only models served as embedders and rerankers: BERT and XLM-RoBERTa (bge-m3,
bge-reranker, the MiniLM sentence-transformers and cross-encoders).

- `BertModel`, `XLMRobertaModel` (`engine.kind: embed`): the final hidden states pooled per
  prompt as the checkpoint's sentence-transformers pooling says (`1_Pooling/config.json`: the
  CLS token, the mean of the tokens, or the last token; CLS where it says nothing).
- `BertForSequenceClassification`, `XLMRobertaForSequenceClassification` (`engine.kind:
  rerank`): the CLS token through the checkpoint's classifier (BERT: its pooler's dense + tanh,
  then `classifier`; XLM-RoBERTa: `classifier.dense` + tanh, then `classifier.out_proj`); its
  logits are the scores (`step_pooling`).

Post-norm layers (attention, then LayerNorm of the residual sum; GELU MLP, the same), absolute
position embeddings (XLM-RoBERTa's counted from `pad_token_id + 1`, as its position ids are), and
token types: a token's type is the number of separator tokens before it in its prompt, as BERT's
tokenizer types a (query, document) pair. Attention is bidirectional within a prompt
(`backends.encoder`), so the scheduler plans each prompt whole and nothing is cached. The
pooled row of each prompt is written at its last token, the row the runner hands the head.

Tensor-parallel as the decoders: q/k/v column-parallel, the attention output and the MLP's
second projection row-parallel, the word embeddings vocabulary-parallel; the rest is small and
replicated."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from dgpp.engine.backends.base import StepMetadata
from dgpp.engine.backends.encoder import EncoderAttentionBackend, EncoderRows, NoCacheSpec
from dgpp.engine.backends.state_cache import LinearStateSpec
from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.configuration.parallel import ParallelContext
from dgpp.engine.errors import ConfigError
from dgpp.engine.layers.embedding import VocabParallelEmbedding
from dgpp.engine.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear

XLM_ROBERTA = ("XLMRobertaModel", "XLMRobertaForSequenceClassification")
_PREFIXES = ("bert.", "roberta.", "model.")
_UNUSED = ("cls.", "lm_head.", "embeddings.position_ids")  # MLM heads, a stored buffer


class EncoderAttention(nn.Module):
    """A cache layer that caches nothing (`NoCacheSpec`): bidirectional attention in each prompt."""

    def __init__(self, config: ModelConfig, parallel: ParallelContext, backend: Any) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, config.head_dim, config.num_heads, config.num_heads, True, parallel
        )
        self.heads = self.qkv_proj.num_heads_local
        self.head_dim = config.head_dim
        heads = self.qkv_proj.heads
        self.dense = RowParallelLinear(
            config.num_heads * config.head_dim, config.hidden_size, True, parallel,
            input_range=(heads.q_start * config.head_dim, heads.num_q * config.head_dim),
        )  # fmt: skip
        self._backend = backend
        self.norm = nn.LayerNorm(config.hidden_size, eps=_eps(config))

    @property
    def cache_spec(self) -> NoCacheSpec:
        return NoCacheSpec()

    @property
    def backend(self) -> EncoderAttentionBackend:
        return self._backend

    def bind_cache(self, cache: torch.Tensor) -> None:
        del cache

    def forward(self, hidden: torch.Tensor, rows: EncoderRows) -> torch.Tensor:
        tokens, heads, dim = hidden.shape[0], self.heads, self.head_dim
        q, k, v = self.qkv_proj(hidden).view(tokens, 3 * heads, dim).split(heads, dim=1)
        out = self._backend.forward(q, k, v, rows, dim**-0.5)
        return self.norm(hidden + self.dense(out.reshape(tokens, heads * dim)))


class EncoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, parallel: ParallelContext, backend: Any) -> None:
        super().__init__()
        self.attention = EncoderAttention(config, parallel, backend)
        size = config.intermediate_size
        self.intermediate = ColumnParallelLinear(config.hidden_size, size, True, parallel)
        self.output = RowParallelLinear(size, config.hidden_size, True, parallel)
        self.norm = nn.LayerNorm(config.hidden_size, eps=_eps(config))

    def forward(self, hidden: torch.Tensor, rows: EncoderRows) -> torch.Tensor:
        hidden = self.attention(hidden, rows)
        return self.norm(hidden + self.output(F.gelu(self.intermediate(hidden))))


class BertModel(nn.Module):
    """An encoder's embeddings and layers, pooled per prompt (see the module docstring)."""

    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = {
        "query": ("qkv_proj", "q"),
        "key": ("qkv_proj", "k"),
        "value": ("qkv_proj", "v"),
    }
    whole_prompts = True  # the scheduler computes each prompt in one step
    num_slice_layers = 0
    classifies = False

    def __init__(
        self, config: ModelConfig, parallel: ParallelContext, max_position: int, attention: Any
    ) -> None:
        super().__init__()
        del max_position
        self.config = config
        raw = config.raw
        hidden = config.hidden_size
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, hidden, parallel)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, hidden)
        self.token_type_embeddings = nn.Embedding(int(raw.get("type_vocab_size", 2)), hidden)
        self.embeddings_norm = nn.LayerNorm(hidden, eps=_eps(config))
        layers = [EncoderLayer(config, parallel, attention) for _ in range(config.num_layers)]
        self.layers = nn.ModuleList(layers)
        roberta = config.architecture in XLM_ROBERTA
        self.position_offset = int(raw.get("pad_token_id", 1)) + 1 if roberta else 0
        self.pooling = "cls" if self.classifies else (config.pooling_mode or "cls")

    @classmethod
    def cache_specs(cls, config: ModelConfig, parallel: ParallelContext) -> list[NoCacheSpec]:
        del parallel
        return [NoCacheSpec()] * config.num_layers

    @classmethod
    def state_specs(cls, config: ModelConfig, parallel: ParallelContext) -> list[LinearStateSpec]:
        del config, parallel
        return []

    def checkpoint_name(self, name: str) -> str | None:
        """The model's name for a checkpoint tensor: HF's without the task model's prefix, its
        modules' own names for the norms and embeddings; None for what serving does not run."""
        for prefix in _PREFIXES:
            name = name.removeprefix(prefix)
        if name.startswith(_UNUSED) or (name.startswith("pooler.") and not self.uses_pooler):
            return None
        renames = (
            ("embeddings.word_embeddings.", "word_embeddings."),
            ("embeddings.position_embeddings.", "position_embeddings."),
            ("embeddings.token_type_embeddings.", "token_type_embeddings."),
            ("embeddings.LayerNorm.", "embeddings_norm."),
            ("encoder.layer.", "layers."),
            (".attention.self.", ".attention."),
            (".attention.output.dense.", ".attention.dense."),
            (".attention.output.LayerNorm.", ".attention.norm."),
            (".intermediate.dense.", ".intermediate."),
            (".output.dense.", ".output."),
            (".output.LayerNorm.", ".norm."),
        )
        for old, new in renames:
            name = name.replace(old, new) if old.startswith(".") else _swap(name, old, new)
        return name

    uses_pooler = False

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: StepMetadata
    ) -> torch.Tensor:
        """Hidden states [T, hidden], each prompt's pooled row at its last token."""
        rows: EncoderRows = metadata[EncoderAttentionBackend.name]
        types = self._token_types(input_ids, rows)
        hidden = self.word_embeddings(input_ids)
        hidden = hidden + self.position_embeddings(positions + self.position_offset)
        hidden = self.embeddings_norm(hidden + self.token_type_embeddings(types))
        for layer in self.layers:
            hidden = layer(hidden, rows)
        if self.pooling == "cls":
            pooled = hidden[rows.starts]
        elif self.pooling == "mean":
            sums = hidden.new_zeros(rows.lengths.shape[0], hidden.shape[1])
            sums.index_add_(0, rows.rows, hidden)
            pooled = sums / rows.lengths[:, None].to(hidden.dtype)
        else:  # "last"
            pooled = hidden[rows.ends]
        return hidden.index_copy(0, rows.ends, pooled)

    def _token_types(self, input_ids: torch.Tensor, rows: EncoderRows) -> torch.Tensor:
        """Each token's type: the separators before it in its prompt (0 without a separator
        id, or where the model has one type)."""
        sep, kinds = self.config.sep_token_id, self.token_type_embeddings.num_embeddings
        if sep is None or kinds == 1:
            return torch.zeros_like(input_ids)
        seen = torch.cumsum((input_ids == sep).long(), 0) - (input_ids == sep).long()
        return (seen - seen[rows.starts][rows.rows]).clamp(max=kinds - 1)

    def compute_logits(
        self, hidden: torch.Tensor, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """The pooled rows [N, hidden], as float32: an embedding."""
        del dtype
        return hidden.float()


class BertForSequenceClassification(BertModel):
    """BERT's classifier on the CLS token: pooler dense + tanh, then `classifier` [labels]."""

    classifies = True
    uses_pooler = True

    def __init__(self, config: ModelConfig, *args: Any) -> None:
        super().__init__(config, *args)
        hidden, labels = config.hidden_size, _labels(config)
        self.pooler = nn.ModuleDict({"dense": nn.Linear(hidden, hidden)})
        self.classifier = nn.Linear(hidden, labels)

    def compute_logits(
        self, hidden: torch.Tensor, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        del dtype
        return self.classifier(torch.tanh(self.pooler["dense"](hidden))).float()


class XLMRobertaForSequenceClassification(BertModel):
    """XLM-RoBERTa's classification head on the CLS token: dense + tanh, then `out_proj`."""

    classifies = True

    def __init__(self, config: ModelConfig, *args: Any) -> None:
        super().__init__(config, *args)
        hidden, labels = config.hidden_size, _labels(config)
        self.classifier = nn.ModuleDict(
            {"dense": nn.Linear(hidden, hidden), "out_proj": nn.Linear(hidden, labels)}
        )

    def compute_logits(
        self, hidden: torch.Tensor, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        del dtype
        head = self.classifier
        return head["out_proj"](torch.tanh(head["dense"](hidden))).float()


ENCODER_CLASSES = {
    "BertModel": BertModel,
    "XLMRobertaModel": BertModel,
    "BertForSequenceClassification": BertForSequenceClassification,
    "XLMRobertaForSequenceClassification": XLMRobertaForSequenceClassification,
}


def _swap(name: str, old: str, new: str) -> str:
    return new + name[len(old) :] if name.startswith(old) else name


def _eps(config: ModelConfig) -> float:
    return float(config.raw.get("layer_norm_eps", 1e-12))


def _labels(config: ModelConfig) -> int:
    # transformers writes `id2label` unless it is its default of two labels
    labels = len(config.raw.get("id2label") or {}) or config.raw.get("num_labels") or 2
    if int(labels) not in (1, 2):
        raise ConfigError(
            f"{config.architecture} with {labels} labels: a reranker scores with 1 label (its "
            "sigmoid) or 2 (the second's probability)"
        )
    return int(labels)
