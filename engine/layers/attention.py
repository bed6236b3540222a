"""Paged attention layer: stores this step's keys and values in its cache, then attends."""

from __future__ import annotations

import logging

import torch
from torch import nn

from dgpp.engine.backends.base import PagedAttentionBackend, StepMetadata
from dgpp.engine.backends.cache_spec import PagedKVSpec
from dgpp.engine.errors import ModelLoadError
from dgpp.engine.layers.rotary import RopeAngles

log = logging.getLogger(__name__)


class PagedAttention(nn.Module):
    """A cache layer (`dgpp.engine.backends.cache_spec.CacheLayer`): the model runner binds its
    share of a paged KV pool, [2, blocks, block_size, H_kv, D], before the first forward.

    Options for gpt-oss-style layers (both off by default, leaving plain causal attention):
    - `sliding_window`: a query at position p sees only keys k with p - window < k <= p. The
      cache is the same paged pool (every position's keys stay cached, so a prefix-cache hit
      serves sliding and full layers alike); the backend does not read keys before the window.
    - `has_sinks`: the layer owns `sinks` [num_heads], a learned logit per head that joins each
      softmax's denominator and adds no value. Its `weight_loader` takes the checkpoint's tensor
      of every head and keeps this rank's, from query head `first_head` on
      (`HeadPartition.q_start`)."""

    sinks: nn.Parameter | None
    kv_scale: torch.Tensor | None

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        backend: PagedAttentionBackend,
        *,
        sliding_window: int | None = None,
        has_sinks: bool = False,
        first_head: int = 0,
    ) -> None:
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window={sliding_window} must be at least 1")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.first_head = first_head
        self._backend = backend
        self.cache: torch.Tensor | None = None
        sinks = nn.Parameter(torch.empty(num_heads), requires_grad=False) if has_sinks else None
        self.register_parameter("sinks", sinks)
        if sinks is not None:
            sinks.weight_loader = self.load_sinks  # type: ignore[attr-defined]
        # The checkpoint's static key and value scales, where it has them (`expect_kv_scales`).
        self.register_buffer("kv_scale", None)
        self.static_kv = False

    def expect_kv_scales(self) -> None:
        """Give the layer a `kv_scale` buffer [2] (key, value; 0: none) for the checkpoint's
        `k_scale`/`v_scale` to load into (`checkpoint.kv_scales`); a resident image keeps it."""
        self.register_buffer("kv_scale", torch.zeros(2, dtype=torch.float32))

    def settle_kv_scales(self) -> bool:
        """After the weights are in: whether the layer stores with static scales (both loaded);
        read once here, so a step never syncs on them."""
        scale = self.kv_scale
        self.static_kv = scale is not None and bool((scale > 0).all())
        return self.static_kv

    @property
    def cache_spec(self) -> PagedKVSpec:
        kv_dtype = getattr(self._backend, "kv_dtype", "auto")
        return PagedKVSpec(self.num_kv_heads, self.head_dim, kv_dtype)

    @property
    def backend(self) -> PagedAttentionBackend:
        return self._backend

    def bind_cache(self, cache: torch.Tensor) -> None:
        self.cache = cache

    def load_sinks(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: None = None) -> None:
        """Copy heads first_head .. first_head + num_heads of the checkpoint's sinks [heads].
        `shard_id` is what a model's `checkpoint_target` rule passes: there is no shard."""
        del shard_id
        end = self.first_head + self.num_heads
        if loaded.dim() != 1 or loaded.shape[0] < end:
            raise ModelLoadError(
                f"attention sinks of shape {tuple(loaded.shape)}; this rank needs heads "
                f"{self.first_head} .. {end - 1}"
            )
        param.data.copy_(loaded[self.first_head : end])

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        metadata: StepMetadata,
        angles: RopeAngles | None = None,
    ) -> torch.Tensor:
        """query [T, H, D], key/value [T, H_kv, D]; returns [T, H, D]. With `angles` (only
        where the backend `fuses_rope`) query and key are not rotated yet: the backend rotates
        them as it stores the key."""
        assert self.cache is not None, "the model runner binds every cache before a forward"
        backend = self._backend
        return backend.forward(
            query,
            key,
            value,
            self.cache,
            metadata[backend.name],
            self.scale,
            self.sinks,
            self.sliding_window,
            angles,
            self.kv_scale if self.static_kv else None,
        )

    @property
    def fuses_rope(self) -> bool:
        """Whether the backend rotates query and key in its store (pass `angles`)."""
        return getattr(self._backend, "fuses_rope", False)


def expect_kv_scales(model: nn.Module, declared: bool) -> None:
    """Before the weights load: a `kv_scale` buffer in every paged attention layer, where the
    checkpoint `declared` static KV scales (`ModelConfig.kv_scales`)."""
    for module in model.modules():
        if declared and type(module) is PagedAttention:
            module.expect_kv_scales()


def settle_kv_scales(model: nn.Module, kv_cache_dtype: str) -> int:
    """After the weights load (from the checkpoint or a resident image): the layers that store
    with the checkpoint's static scales, logged; they count at fp8_e4m3 only."""
    layers = [m for m in model.modules() if type(m) is PagedAttention and m.kv_scale is not None]
    static = sum(layer.settle_kv_scales() for layer in layers)
    if static and kv_cache_dtype != "fp8_e4m3":
        for layer in layers:
            layer.static_kv = False
        log.info(
            "the checkpoint's static KV scales (%d layers) apply at kv_cache_dtype=fp8_e4m3; "
            "this engine's %s cache keeps its own scales",
            static,
            kv_cache_dtype,
        )
        return 0
    if layers:
        log.info("%d of %d paged attention layers store at the checkpoint's FP8 KV scales",
                 static, len(layers))  # fmt: skip
    return static
