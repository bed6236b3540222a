"""Per-layer cache specs: each layer with a cache declares what it needs, and one pool per spec
is sized by the memory plan and allocated by the model runner.

Every spec is paged by the same block ids: a request's block table indexes every pool, so one
block manager serves a model whose layers need caches of different widths.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any, Protocol, runtime_checkable

import torch

from dgpp.engine.backends.base import AttentionBackend
from dgpp.engine.errors import ConfigError
from dgpp.kernels.kv_quant import KvFormat, kv_format
from dgpp.kernels.latent_quant import RowFormat, index_key_format, row_format


class CacheSpec(Protocol):
    """A kind of cache. Specs are hashable values; layers with equal specs share one tensor."""

    block_axis: int  # the blocks' dimension of the tensor `allocate` returns

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes one token's slot takes in one layer's cache."""
        ...

    def allocate(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor:
        """The zeroed cache of `num_layers` layers; index 0 is one layer's share."""
        ...


@dataclass(frozen=True)
class PagedKVSpec:
    """Keys and values of `num_kv_heads` heads of `head_dim` per token: per layer
    [2, blocks, block_size, num_kv_heads, head_dim] in the model dtype, or with a quantized
    `kv_dtype` (`kernels.kv_quant`) uint8 [2, blocks, block_size, num_kv_heads, width]: each head
    its blocks of scale and codes."""

    num_kv_heads: int
    head_dim: int
    kv_dtype: str = "auto"
    block_axis = 2  # of the pool `allocate` returns

    @property
    def kv_format(self) -> KvFormat | None:
        return kv_format(self.kv_dtype, self.head_dim)

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        fmt = self.kv_format
        if fmt is not None:
            return 2 * self.num_kv_heads * fmt.width
        return 2 * self.num_kv_heads * self.head_dim * dtype.itemsize

    def allocate(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor:
        fmt = self.kv_format
        if fmt is not None:
            shape = (num_layers, 2, num_blocks, block_size, self.num_kv_heads, fmt.width)
            return torch.zeros(shape, dtype=torch.uint8, device=device)
        shape = (num_layers, 2, num_blocks, block_size, self.num_kv_heads, self.head_dim)
        return torch.zeros(shape, dtype=dtype, device=device)


class _TokenRowSpec:
    """A cache of one vector of `width` per token, shared by every head (so every rank of a
    tensor-parallel world holds all of it): per layer [blocks, block_size, width] in the model
    dtype, or with a quantized `kv_dtype` uint8 [blocks, block_size, bytes] in its
    `row_format` (`kernels.latent_quant`)."""

    block_axis = 1  # of the pool `allocate` returns
    kv_dtype: str

    @property
    def width(self) -> int:
        raise NotImplementedError

    @property
    def row_format(self) -> RowFormat | None:
        raise NotImplementedError

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        fmt = self.row_format
        return self.width * dtype.itemsize if fmt is None else fmt.width(dtype)

    def allocate(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor:
        fmt = self.row_format
        if fmt is not None:
            shape = (num_layers, num_blocks, block_size, fmt.width(dtype))
            return torch.zeros(shape, dtype=torch.uint8, device=device)
        shape = (num_layers, num_blocks, block_size, self.width)
        return torch.zeros(shape, dtype=dtype, device=device)


@dataclass(frozen=True)
class MLALatentSpec(_TokenRowSpec):
    """Multi-head latent attention's cache: per token the normalised compressed key/value
    latent (`kv_lora_rank`) and the rotated shared rope key (`rope_dim`). Quantized, the latent
    takes the `kv_dtype`'s blocks and the rope key stays in the model dtype."""

    kv_lora_rank: int
    rope_dim: int
    kv_dtype: str = "auto"

    @property
    def width(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    @property
    def row_format(self) -> RowFormat | None:
        return row_format(self.kv_dtype, self.kv_lora_rank, self.rope_dim)


@dataclass(frozen=True)
class IndexerKeySpec(_TokenRowSpec):
    """A sparse-attention indexer's keys (`dgpp.engine.layers.indexer_keys`): one key of
    `head_dim` per token, paged by the same block ids as the layer's attention cache (a
    prefix-cache hit reuses both). Quantized, in 8 bits (`latent_quant.index_key_format`)."""

    head_dim: int
    kv_dtype: str = "auto"

    @property
    def width(self) -> int:
        return self.head_dim

    @property
    def row_format(self) -> RowFormat | None:
        return index_key_format(self.kv_dtype, self.head_dim)


@runtime_checkable
class CacheLayer(Protocol):
    """A module that owns a cache: the runner finds these, allocates by `cache_spec` and binds
    each one's share; `backend` prepares the metadata its forward reads."""

    @property
    def cache_spec(self) -> CacheSpec: ...

    @property
    def backend(self) -> AttentionBackend: ...

    def bind_cache(self, cache: torch.Tensor) -> None: ...


def with_kv_dtype(specs: Iterable[CacheSpec], kv_dtype: str, family: str) -> list[CacheSpec]:
    """`specs` with paged keys and values, MLA latents, indexer keys and DeepSeek-V4's
    compressed keys (`layers.compressed_keys`) stored at `kv_dtype`; `ConfigError` for a family
    with another cache kind (a cache declaring no `kv_dtype`)."""
    specs = list(specs)
    if kv_dtype == "auto":
        return specs
    refused = {type(spec) for spec in specs if not hasattr(spec, "kv_dtype")}
    if refused:
        names = ", ".join(sorted(kind.__name__ for kind in refused))
        raise ConfigError(
            f"kv_cache_dtype={kv_dtype}: {family}'s {names} cache is stored at the model dtype "
            "only so far; the value that works for it: auto"
        )
    return [at_kv_dtype(spec, kv_dtype) for spec in specs]


def at_kv_dtype(spec: Any, kv_dtype: str) -> Any:
    """`spec` (a dataclass with a `kv_dtype` field) at `kv_dtype`, its format built now so that
    a width the format cannot take is a `ConfigError` with the values that work."""
    quantized = replace(spec, kv_dtype=kv_dtype)
    try:
        if isinstance(quantized, PagedKVSpec):
            quantized.kv_format  # noqa: B018 (raises for a width the format cannot take)
        elif hasattr(quantized, "row_format"):
            quantized.row_format  # noqa: B018
        else:
            quantized.slot_numel  # noqa: B018 (a state's rows)
    except ValueError as err:
        raise ConfigError(
            f"kv_cache_dtype={kv_dtype}: {err}; values that work: auto, int8, fp8_e4m3"
        ) from None
    return quantized


def cache_layers(model: torch.nn.Module) -> list[CacheLayer]:
    """The model's cache layers, in module order."""
    return [module for module in model.modules() if isinstance(module, CacheLayer)]


def allocate_caches(
    layers: Iterable[CacheLayer],
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    """One tensor per distinct spec, in first-use order; each layer is bound to its share."""
    groups: dict[CacheSpec, list[CacheLayer]] = {}
    for layer in layers:
        groups.setdefault(layer.cache_spec, []).append(layer)
    pools = []
    for spec, members in groups.items():
        pool = spec.allocate(len(members), num_blocks, block_size, dtype, device)
        for index, layer in enumerate(members):
            layer.bind_cache(pool[index])
        pools.append(pool)
    return pools


def unique_backends(layers: Iterable[CacheLayer]) -> list[AttentionBackend]:
    """The backends the layers use, each once (by name), in first-use order."""
    found: dict[str, AttentionBackend] = {}
    for layer in layers:
        found.setdefault(layer.backend.name, layer.backend)
    return list(found.values())
