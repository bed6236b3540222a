"""The rank's side of MTP drafting: the MTP layer, its KV cache, the last step's target hidden
states, and the draft pass (`dgpp.engine.speculative.mtp_drafter` builds the messages). It is
the model runner's `Drafting`, built from what the runner hands it (`DraftTarget`); the front
and the workers hand the runner `drafter_for(config)`."""

from __future__ import annotations

from typing import Any

import torch

from dgpp.engine.backends.base import BatchLayout, BatchRow
from dgpp.engine.backends.cache_spec import allocate_caches, cache_layers
from dgpp.engine.checkpoint.loader import load_weights
from dgpp.engine.configuration.engine_config import EngineConfig
from dgpp.engine.errors import ConfigError, ModelLoadError
from dgpp.engine.execution.drafting import Drafter, DraftTarget
from dgpp.engine.execution.step_message import BlockTables, StepMessage
from dgpp.engine.layers.linear import PackableLinear
from dgpp.engine.models.mtp import MtpLayer, mtp_layer_count


def drafter_for(config: EngineConfig) -> Drafter | None:
    """The drafter a runner of `config` builds beside its model: MTP's layers, or none."""
    return MtpDrafting.build if config.speculative == "mtp" else None


class MtpDrafting:
    """The MTP layer of a runner's model and what a draft pass reads."""

    def __init__(self, layer: Any, backend: Any, caches: list[torch.Tensor]) -> None:
        self.layer = layer
        self.backend = backend
        self.caches = caches
        self.vocab_size = layer.config.vocab_size
        self._hidden: torch.Tensor | None = None
        self._rows: dict[int, tuple[int, int]] = {}  # seq id -> (first index, first position)

    @classmethod
    def build(cls, target: DraftTarget) -> MtpDrafting:
        """Layer `num_hidden_layers` of the checkpoint, sharded like the target's layers, its
        weights read from the checkpoint, its cache as large as the target's pool."""
        config, model = target.model_config, target.model
        if not getattr(model, "mtp_supported", True):
            raise ConfigError(
                f"speculative=mtp: dgpp does not build {config.architecture}'s MTP layers "
                f"(hyper-connection streams); use --spec ngram or off"
            )
        count = mtp_layer_count(config.raw)
        if count < 1 or not hasattr(model, "build_layer"):
            raise ConfigError(
                f"speculative=mtp needs a checkpoint with multi-token-prediction layers "
                f"(num_nextn_predict_layers or mtp_num_hidden_layers) of a DeepSeek-V3, "
                f"GLM-4.5, Qwen3-Next or Qwen3.5 family model; {config.architecture} declares "
                f"{count}: use --spec ngram or off"
            )
        with torch.device("cpu"):
            layer = getattr(model, "mtp_layer", MtpLayer)(
                model, target.parallel, target.attention, config.num_layers
            )
        layer = layer.to(target.dtype)
        try:
            load_weights(layer, target.checkpoint)
        except ModelLoadError as err:
            raise ConfigError(
                f"speculative=mtp: the checkpoint declares {count} multi-token-prediction layers "
                f"but does not hold the weights of the first ({err}); use --spec ngram or off"
            ) from None
        layer = layer.to(target.device).eval()
        for module in layer.modules():
            if isinstance(module, PackableLinear):
                module.select_kernels()  # packed (quantized) weights: their kernel, once
        caches = allocate_caches(
            cache_layers(layer),
            target.num_blocks,
            target.block_size,
            target.dtype,
            target.device,
        )
        return cls(layer, target.attention, caches)

    def keep(self, message: StepMessage, hidden: torch.Tensor) -> None:
        """The step's target hidden states [T, H] (final-normed) and where each row's are."""
        self._hidden = hidden
        self._rows = {}
        at = 0
        for row in message.rows:
            self._rows[row.seq_id] = (at, row.start)
            at += row.num_tokens

    def draft(
        self, message: StepMessage, tables: BlockTables, block_size: int, config: EngineConfig
    ) -> list[tuple[int, ...]]:
        """Each row's positions through the MTP layer (its cache written, as a prefill), then
        the chain: the greedy token at each row's last position, and `num_sampled - 1` more by
        feeding the layer its own hidden state and token one position on."""
        assert self._hidden is not None, "a draft pass follows a step"
        index: list[int] = []
        positions: list[int] = []
        next_ids: list[int] = []
        rows = []
        for row in message.rows:
            first, start = self._rows[row.seq_id]
            offset = first + row.start - start
            index.extend(range(offset, offset + row.num_tokens))
            positions.extend(range(row.start, row.seq_len))
            next_ids.extend(row.token_ids)
            rows.append(BatchRow(row.start, row.num_tokens, tables[row.seq_id]))
        device = self._hidden.device
        fp32 = config.prefill_precision == "fp32"

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        layout = BatchLayout(tuple(rows), 0, block_size, fp32)
        out = self._pass(self._hidden.index_select(0, tensor(index)), next_ids, positions, layout)
        ends = tensor([row.num_tokens for row in message.rows]).cumsum(0) - 1
        hidden = out.index_select(0, ends)  # each row's last position's
        tokens = self._greedy(hidden)
        wanted = [row.num_sampled for row in message.rows]
        drafts = [[token] if count else [] for token, count in zip(tokens, wanted, strict=True)]
        for step in range(1, max(wanted, default=0)):
            active = [i for i, count in enumerate(wanted) if count > step]
            chain = tuple(
                BatchRow(message.rows[i].seq_len - 1 + step, 1, tables[message.rows[i].seq_id])
                for i in active
            )
            at = [message.rows[i].seq_len - 1 + step for i in active]
            picked = tensor(active)
            previous = [drafts[i][-1] for i in active]
            out = self._pass(
                hidden.index_select(0, picked),
                previous,
                at,
                BatchLayout(chain, len(chain), block_size, fp32),
            )
            hidden = hidden.index_copy(0, picked, out)
            for i, token in zip(active, self._greedy(out), strict=True):
                drafts[i].append(token)
        return [tuple(draft) for draft in drafts]

    def _pass(
        self, hidden: torch.Tensor, next_ids: list[int], positions: list[int], layout: BatchLayout
    ) -> torch.Tensor:
        device = hidden.device
        metadata = {self.backend.name: self.backend.prepare(layout)}
        ids = torch.tensor(next_ids, dtype=torch.int64, device=device)
        at = torch.tensor(positions, dtype=torch.int64, device=device)
        return self.layer(hidden, ids, at, metadata)

    def _greedy(self, hidden: torch.Tensor) -> list[int]:
        logits = self.layer.compute_logits(hidden)
        return logits[:, : self.vocab_size].argmax(dim=-1).tolist()
