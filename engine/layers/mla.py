"""Multi-head latent attention (MLA, DeepSeek-V2/V3): queries through an optional low-rank
projection; keys and values through one compressed latent per token, which is all the cache
keeps (`dgpp.engine.backends.cache_spec.MLALatentSpec`).

Tensor-parallel layout: the query up-projection (`q_b_proj`, or `q_proj` without a query rank)
and the key/value up-projection `kv_b_proj` are split by head, the output projection is
row-parallel; the down-projections (`q_a_proj`, `kv_a_proj_with_mqa`) and the latent cache are
replicated, since every head reads the same latent.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from dgpp.engine.backends.base import StepMetadata
from dgpp.engine.backends.cache_spec import MLALatentSpec
from dgpp.engine.backends.mla_base import MLABackend
from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.configuration.parallel import ParallelContext
from dgpp.engine.errors import ModelLoadError
from dgpp.engine.layers.head_partition import partition_heads
from dgpp.engine.layers.linear import PackableLinear, RowParallelLinear
from dgpp.engine.layers.norm import RMSNorm
from dgpp.engine.layers.rotary import RopeAngles, apply_rotary, deinterleave, mscale_softmax_factor

# transformers builds the two latent norms with RMSNorm's default epsilon, not `rms_norm_eps`.
LATENT_NORM_EPS = 1e-6


@dataclass(frozen=True)
class MLADims:
    """The MLA shapes of a checkpoint: ranks of the query and key/value latents (`q_lora_rank`
    None: a plain query projection), per-head widths, and whether rope dims come in pairs."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    use_nope: bool = False  # Kimi-Linear: the rope dims are never rotated (`mla_use_nope`)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_spec(self) -> MLALatentSpec:
        return MLALatentSpec(self.kv_lora_rank, self.qk_rope_head_dim)

    @classmethod
    def of(cls, config: ModelConfig) -> MLADims:
        raw = config.raw
        try:
            q_rank = raw.get("q_lora_rank")
            return cls(
                q_lora_rank=None if q_rank is None else int(q_rank),
                kv_lora_rank=int(raw["kv_lora_rank"]),
                qk_nope_head_dim=int(raw["qk_nope_head_dim"]),
                qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
                v_head_dim=int(raw["v_head_dim"]),
                rope_interleave=bool(raw.get("rope_interleave", True)),
                use_nope=bool(raw.get("mla_use_nope", raw.get("model_type") == "kimi_linear")),
            )
        except KeyError as missing:
            raise ModelLoadError(f"config.json lacks the MLA key {missing}") from None


class RowSliceLinear(PackableLinear):
    """Y = X W[rows]^T for one contiguous range (start, size) of W's output rows: all of them
    (replicated on every rank) or this rank's heads. Dense weights."""

    def __init__(self, input_size: int, rows: tuple[int, int], bias: bool) -> None:
        super().__init__()
        self.row_start, size = rows
        self.init_weight(size, input_size, None)
        self.weight.weight_loader = self.load_rows  # type: ignore[union-attr]
        self.bias = nn.Parameter(torch.empty(size), requires_grad=False) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.load_rows  # type: ignore[attr-defined]

    def load_rows(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.copy_(loaded.narrow(0, self.row_start, param.shape[0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x)


class LatentUpProjection(nn.Module):
    """`kv_b_proj`: this rank's heads' rows [H * (N + V), L] of the key/value up-projection.
    Kept dense and never packed: decode reads its per-head key and value blocks directly."""

    def __init__(self, dims: MLADims, head_start: int, num_heads: int) -> None:
        super().__init__()
        self.rows_per_head = dims.qk_nope_head_dim + dims.v_head_dim
        self.row_start = head_start * self.rows_per_head
        rows = num_heads * self.rows_per_head
        self.weight = nn.Parameter(torch.empty(rows, dims.kv_lora_rank), requires_grad=False)
        self.weight.weight_loader = self.load_rows  # type: ignore[attr-defined]

    def load_rows(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.copy_(loaded.narrow(0, self.row_start, param.shape[0]))

    def per_head(self) -> torch.Tensor:
        """The weight as [H, N + V, L] (a view)."""
        return self.weight.view(-1, self.rows_per_head, self.weight.shape[1])


class LatentAttention(nn.Module):
    """A cache layer (`dgpp.engine.backends.cache_spec.CacheLayer`): the model runner binds its
    share of a latent pool, [blocks, block_size, L + R], before the first forward."""

    def __init__(self, dims: MLADims, scale: float, backend: MLABackend) -> None:
        super().__init__()
        self.dims = dims
        self.scale = scale
        self._backend = backend
        self.cache: torch.Tensor | None = None

    @property
    def cache_spec(self) -> MLALatentSpec:
        kv_dtype = getattr(self._backend, "kv_dtype", "auto")
        return replace(self.dims.cache_spec, kv_dtype=kv_dtype)

    @property
    def backend(self) -> MLABackend:
        return self._backend

    def bind_cache(self, cache: torch.Tensor) -> None:
        self.cache = cache

    def forward(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent: torch.Tensor,
        kv_b: torch.Tensor,
        metadata: StepMetadata,
    ) -> torch.Tensor:
        """q_nope [T, H, N], q_pe [T, H, R], latent [T, L + R], kv_b [H, N + V, L]; returns
        [T, H, V]."""
        assert self.cache is not None, "the model runner binds every cache before a forward"
        backend = self._backend
        return backend.forward(
            q_nope, q_pe, latent, self.cache, kv_b, metadata[backend.name], self.scale
        )


class MultiHeadLatentAttention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        backend: MLABackend,
    ) -> None:
        """Every projection is dense: a quantized checkpoint's are dequantized at load."""
        super().__init__()
        dims = MLADims.of(config)
        self.dims = dims
        heads = partition_heads(
            config.num_heads, config.num_heads, parallel.tp_size, parallel.tp_rank
        )
        self.num_heads = heads.num_q
        hidden, bias = config.hidden_size, config.qkv_bias  # `attention_bias`: the a-projections
        q_rows = (heads.q_start * dims.qk_head_dim, heads.num_q * dims.qk_head_dim)
        self.q_proj: RowSliceLinear | None = None
        self.q_a_proj: RowSliceLinear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: RowSliceLinear | None = None
        if dims.q_lora_rank is None:
            self.q_proj = RowSliceLinear(hidden, q_rows, bias=False)
        else:
            self.q_a_proj = RowSliceLinear(hidden, (0, dims.q_lora_rank), bias)
            self.q_a_layernorm = RMSNorm(dims.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = RowSliceLinear(dims.q_lora_rank, q_rows, bias=False)
        latent_width = dims.cache_spec.width
        self.kv_a_proj_with_mqa = RowSliceLinear(hidden, (0, latent_width), bias)
        self.kv_a_layernorm = RMSNorm(dims.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = LatentUpProjection(dims, heads.q_start, heads.num_q)
        v = dims.v_head_dim
        self.o_proj = RowParallelLinear(
            config.num_heads * v,
            hidden,
            config.o_proj_bias,
            parallel,
            input_range=(heads.q_start * v, heads.num_q * v),
        )
        scale = dims.qk_head_dim**-0.5 * mscale_softmax_factor(config.rope)
        self.attn = LatentAttention(dims, scale, backend)

    def forward(
        self,
        angles: RopeAngles,
        hidden: torch.Tensor,
        metadata: StepMetadata,
    ) -> torch.Tensor:
        """hidden [T, hidden] -> [T, hidden]; `angles` are the rope dims' (cos, signed sin)."""
        q_nope, q_pe, latent, _ = self.project(angles, hidden)
        out = self.attn(q_nope, q_pe, latent, self.kv_b_proj.per_head(), metadata)  # [T, H, V]
        return self.output(out)

    def project(
        self, angles: RopeAngles, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(q_nope [T, H, N], rotated q_pe [T, H, R], latent [T, L + R], the normed query
        latent [T, q_lora_rank] or None without a query rank) of hidden [T, hidden]."""
        dims = self.dims
        num_tokens = hidden.shape[0]
        q_resid = None
        if self.q_proj is not None:
            q = self.q_proj(hidden)
        else:
            q_a, q_norm, q_b = self.q_a_proj, self.q_a_layernorm, self.q_b_proj
            assert q_a is not None and q_norm is not None and q_b is not None
            q_resid = q_norm(q_a(hidden))
            q = q_b(q_resid)  # [T, H * (N + R)]
        q = q.view(num_tokens, self.num_heads, dims.qk_head_dim)
        q_nope, q_pe = q.split([dims.qk_nope_head_dim, dims.qk_rope_head_dim], dim=-1)
        compressed = self.kv_a_proj_with_mqa(hidden)  # [T, L + R]
        kv, k_pe = compressed.split([dims.kv_lora_rank, dims.qk_rope_head_dim], dim=-1)
        k_pe = k_pe.unsqueeze(1)  # [T, 1, R]: one rope key shared by every head
        if not dims.use_nope:
            if dims.rope_interleave:
                q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
            q_pe, k_pe = apply_rotary(q_pe, angles), apply_rotary(k_pe, angles)  # [T, H, R]
        latent = torch.cat((self.kv_a_layernorm(kv), k_pe.squeeze(1)), dim=-1)  # [T, L + R]
        return q_nope, q_pe, latent, q_resid

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """The attention's output [T, H, V] through `o_proj`: [T, hidden]."""
        return self.o_proj(out.reshape(out.shape[0], self.num_heads * self.dims.v_head_dim))
