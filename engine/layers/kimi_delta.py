"""Kimi Delta Attention (KDA), the linear-attention layer of Kimi-Linear: Gated DeltaNet with a
forget gate per key channel instead of per head.

Per token: q, k, v projections (one head width `linear_head_dim` for all three) through a short
depthwise causal convolution with SiLU; a write strength beta = sigmoid(b_proj(x)) per head; a
log decay per key channel, g = -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias), through a
low-rank pair of projections; the gated delta rule on L2-normed q and k (fla's `chunk_kda` and
`fused_recurrent_kda` on CUDA, the twins in `kernels.gated_delta_torch` elsewhere); an RMSNorm
per head gated by sigmoid(g_b(g_a(x))); the output projection.

The state per request is Gated DeltaNet's (`LinearStateSpec`: the convolution's last inputs and
a [K, V] matrix per head), so prefix snapshots, preemption and speculative verify rows work as
for Qwen3-Next. Checkpoint names are the release's: separate `q_conv1d` / `k_conv1d` /
`v_conv1d`, loaded into one conv weight by the model's target rule.

Tensor parallel: whole heads per rank (q, k, v, beta, the decay's `f_b_proj`, `dt_bias`, `A_log`
and the output gate's `g_b_proj` split by head; the low-rank down projections `f_a_proj` and
`g_a_proj` replicated), the output projection split on its input: one all-reduce.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dgpp.engine.backends.base import StepMetadata
from dgpp.engine.backends.state_cache import LinearStateBackend, LinearStateSpec, StateRows
from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.configuration.parallel import ParallelContext
from dgpp.engine.errors import ConfigError, ModelLoadError
from dgpp.engine.layers.delta_state import ConvDeltaLayer, head_param
from dgpp.engine.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from dgpp.engine.layers.mla import RowSliceLinear
from dgpp.engine.layers.norm import GatedRMSNorm
from dgpp.engine.layers.rotary import RopeAngles
from dgpp.kernels.gated_delta import GatedDeltaFns, select_kimi_delta


def kda_dims(config: ModelConfig) -> tuple[int, int, int]:
    """(heads, head dim, conv width) from transformers' keys or the release's
    `linear_attn_config`."""
    raw = config.raw
    nested = raw.get("linear_attn_config") or {}
    try:
        heads = int(raw.get("linear_num_heads") or nested["num_heads"])
        dim = int(raw.get("linear_head_dim") or nested["head_dim"])
        width = int(raw.get("linear_conv_kernel_dim") or nested.get("short_conv_kernel_size", 4))
    except KeyError as missing:
        raise ModelLoadError(f"config.json lacks the linear attention key {missing}") from None
    return heads, dim, width


def kda_state_spec(config: ModelConfig, parallel: ParallelContext) -> LinearStateSpec:
    """One KDA layer's state on a rank of `parallel` (refused when its heads do not split)."""
    heads, dim, width = kda_dims(config)
    if heads % parallel.tp_size:
        raise ConfigError(f"KDA's {heads} heads cannot be split over {parallel.tp_size} ranks")
    local = heads // parallel.tp_size
    return LinearStateSpec(3 * local * dim, width, local, dim, dim)


class KimiConv(nn.Module):
    """The conv weight [3 * local channels, W]: this rank's q, k and v channels, loaded from
    the release's three [H * D, 1, W] tensors (shard 0, 1, 2)."""

    def __init__(self, spec: LinearStateSpec, rank: int) -> None:
        super().__init__()
        self.local, self.rank = spec.conv_dim // 3, rank
        self.weight = nn.Parameter(torch.empty(spec.conv_dim, spec.conv_width), requires_grad=False)
        self.weight.weight_loader = self.load  # type: ignore[attr-defined]

    def load(self, param: nn.Parameter, loaded: torch.Tensor, shard: int) -> None:
        if loaded.dim() != 3 or loaded.shape[2] != param.shape[1]:
            raise ModelLoadError(f"a KDA conv weight of shape {tuple(loaded.shape)}")
        start = self.rank * self.local
        part = loaded[start : start + self.local, 0]
        param.data[shard * self.local : (shard + 1) * self.local].copy_(part)


class KimiDeltaAttention(ConvDeltaLayer):
    """A state layer (`dgpp.engine.backends.state_cache.StateLayer`) with attention's
    `forward(angles, hidden, metadata)` (the angles unused: KDA has no positions)."""

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        backend: LinearStateBackend,
        prefix: str,
    ) -> None:
        super().__init__()
        heads, dim, _ = kda_dims(config)
        self.init_state(kda_state_spec(config, parallel), backend)
        hidden, local = config.hidden_size, self.spec.num_heads
        first = parallel.tp_rank * local
        self.num_heads, self.head_dim = local, dim
        names = [f"{prefix}.{n}" for n in ("q_proj", "k_proj", "v_proj")]
        self.qkv_proj = QKVParallelLinear(
            hidden, dim, heads, heads, False, parallel, config.weight_format(names, hidden)
        )
        self.conv1d = KimiConv(self.spec, parallel.tp_rank)
        self.f_a_proj = RowSliceLinear(hidden, (0, dim), bias=False)
        self.f_b_proj = ColumnParallelLinear(dim, heads * dim, False, parallel)
        self.dt_bias = head_param(first, local, dim)
        self.A_log = head_param(first, local, 1)
        self.b_proj = ColumnParallelLinear(hidden, heads, False, parallel)
        self.g_a_proj = RowSliceLinear(hidden, (0, dim), bias=False)
        self.g_b_proj = ColumnParallelLinear(dim, heads * dim, False, parallel)
        self.o_norm = GatedRMSNorm(dim, config.rms_norm_eps, "sigmoid")
        self.o_proj = RowParallelLinear(
            heads * dim,
            hidden,
            False,
            parallel,
            weight_format=config.weight_format(
                [f"{prefix}.o_proj"], local * dim, first * dim, heads * dim
            ),
        )
        self._kernels: GatedDeltaFns | None = None

    def forward(
        self, angles: RopeAngles, hidden: torch.Tensor, metadata: StepMetadata
    ) -> torch.Tensor:
        del angles
        assert self.state is not None, "the model runner binds every state before a forward"
        rows: StateRows = metadata[self._backend.name]
        if self._kernels is None:
            self._kernels = select_kimi_delta(hidden.device)
        tokens, heads, dim = hidden.shape[0], self.num_heads, self.head_dim
        mixed = self.qkv_proj(hidden)  # [T, 3 * H * D], the conv's channel order
        decay = self.f_b_proj(self.f_a_proj(hidden)).float() + self.dt_bias.float()
        g = -self.A_log.float().exp()[:, None] * F.softplus(decay.view(tokens, heads, dim))
        beta = self.b_proj(hidden).float().sigmoid()
        out = hidden.new_empty(tokens, heads, dim)
        self.run_rows(rows, mixed, g, beta, out)
        gate = self.g_b_proj(self.g_a_proj(hidden)).view(tokens, heads, dim)
        return self.o_proj(self.o_norm(out, gate).reshape(tokens, heads * dim))

    def _heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The convolved [B, T, 3 * H * D] as q, k, v [B, T, H, D]."""
        batch, length = x.shape[:2]
        q, k, v = x.view(batch, length, 3, self.num_heads, self.head_dim).unbind(2)
        return q, k, v
