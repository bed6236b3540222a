"""Gated DeltaNet, the linear-attention layer of Qwen3-Next: projections to q/k/v, an output
gate z and the per-head write strength b and decay a; a short depthwise causal convolution over
q/k/v; the gated delta rule on L2-normed q/k (chunk-parallel for prefill chunks, recurrent for
decode rows); a gated RMSNorm per head; the output projection.

Its cache is a fixed-size state per request (`dgpp.engine.backends.state_cache`): the convolution's
last inputs and the recurrent state, read and written in the request's slot every step.

Two checkpoint layouts of the input projections: Qwen3-Next fuses them as `in_proj_qkvz` /
`in_proj_ba` with rows grouped by key head ([q | k | v | z] of one key head and the value heads
it serves, then the next); Qwen3.5 (`split=True`) stores `in_proj_qkv` (rows [q of every key
head | k of every key head | v of every value head], the conv's channel order), `in_proj_z`,
`in_proj_b` and `in_proj_a` (rows by value head), which load fused as `in_proj_qkvz` and
`in_proj_ba` (`SplitQKVZLinear`, `MergedColumnParallelLinear`).

Tensor parallel: whole key heads per rank with the value heads they serve (grouped: one
contiguous block of rows; split: this rank's slice of each of the q, k, v, z, b and a blocks),
the matching conv channels, and the output projection split on its input (value-head) columns:
one all-reduce, like attention.
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
from dgpp.engine.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
    WeightFormat,
    _copy_rows,
)
from dgpp.engine.layers.norm import GatedRMSNorm
from dgpp.engine.layers.rotary import RopeAngles
from dgpp.kernels.gated_delta import GatedDeltaFns, select_gated_delta
from dgpp.kernels.group_codes import GroupWeight


def linear_state_spec(config: ModelConfig, parallel: ParallelContext) -> LinearStateSpec:
    """One Gated DeltaNet layer's state on a rank of `parallel` (refused when its key heads do
    not split evenly)."""
    raw = config.raw
    num_k, num_v = int(raw["linear_num_key_heads"]), int(raw["linear_num_value_heads"])
    if num_k % parallel.tp_size or num_v % num_k:
        raise ConfigError(
            f"linear attention with {num_k} key heads and {num_v} value heads cannot be split "
            f"over {parallel.tp_size} ranks (whole key heads per rank)"
        )
    head_k, head_v = int(raw["linear_key_head_dim"]), int(raw["linear_value_head_dim"])
    k_local, v_local = num_k // parallel.tp_size, num_v // parallel.tp_size
    return LinearStateSpec(
        conv_dim=2 * k_local * head_k + v_local * head_v,
        conv_width=int(raw["linear_conv_kernel_dim"]),
        num_heads=v_local,
        head_k_dim=head_k,
        head_v_dim=head_v,
    )


class DepthwiseConv(nn.Module):
    """The conv1d's weight [conv_dim, W] on this rank: its q, k and v channels, each a slice of
    the checkpoint's [q | k | v] channel blocks ([conv_dim, 1, W])."""

    def __init__(self, spec: LinearStateSpec, parallel: ParallelContext) -> None:
        super().__init__()
        self.spec, self.rank = spec, parallel.tp_rank
        self.weight = nn.Parameter(torch.empty(spec.conv_dim, spec.conv_width), requires_grad=False)
        self.weight.weight_loader = self.load  # type: ignore[attr-defined]

    def load(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        spec = self.spec
        value_local = spec.num_heads * spec.head_v_dim
        key_local = (spec.conv_dim - value_local) // 2
        world = loaded.shape[0] // spec.conv_dim if loaded.shape[0] % spec.conv_dim == 0 else 0
        if loaded.dim() != 3 or not world or loaded.shape[2] != spec.conv_width:
            raise ModelLoadError(f"conv1d weight of shape {tuple(loaded.shape)}")
        key_full = key_local * world
        starts = (
            self.rank * key_local,
            key_full + self.rank * key_local,
            2 * key_full + self.rank * value_local,
        )
        parts = [
            loaded[start : start + size, 0]
            for start, size in zip(starts, (key_local, key_local, value_local), strict=True)
        ]
        param.data.copy_(torch.cat(parts))


class SplitQKVZLinear(ColumnParallelLinear):
    """Qwen3.5's `in_proj_qkv` (shard 0: rows [q | k | v], each block over every head) and
    `in_proj_z` (shard 1: value-head rows) as one projection: this rank's rows [q | k | v | z],
    each its slice of the checkpoint's block (the split `DepthwiseConv.load` makes of channels)."""

    def __init__(
        self,
        hidden_size: int,
        key_dim: int,
        value_dim: int,
        parallel: ParallelContext,
        weight_format: WeightFormat = None,
    ) -> None:
        self.blocks = ((key_dim, key_dim, value_dim), (value_dim,))
        super().__init__(hidden_size, 2 * key_dim + 2 * value_dim, False, parallel, weight_format)

    def load_rows(  # type: ignore[override]
        self, param: nn.Parameter, loaded: torch.Tensor | GroupWeight, shard_id: int
    ) -> None:
        world, rank = self.parallel.tp_size, self.parallel.tp_rank
        dst = 0 if shard_id == 0 else sum(self.blocks[0]) // world
        src = 0
        for full in self.blocks[shard_id]:
            local = full // world
            _copy_rows(self, param, loaded, dst, src + rank * local, local)
            dst, src = dst + local, src + full


class GatedDeltaNet(ConvDeltaLayer):
    """A state layer (`dgpp.engine.backends.state_cache.StateLayer`); `forward(angles, hidden,
    metadata)` like attention (the angles are unused: the layer has no positions). `split`:
    Qwen3.5's separate input projections (see the module's docstring)."""

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        backend: LinearStateBackend,
        prefix: str,
        split: bool = False,
    ) -> None:
        super().__init__()
        raw = config.raw
        spec = linear_state_spec(config, parallel)
        self.init_state(spec, backend)
        num_k, num_v = int(raw["linear_num_key_heads"]), int(raw["linear_num_value_heads"])
        self.k_heads, self.v_heads = num_k // parallel.tp_size, spec.num_heads
        self.ratio, self.split = num_v // num_k, split
        head_k, head_v, hidden = spec.head_k_dim, spec.head_v_dim, config.hidden_size
        self.in_proj_qkvz: ColumnParallelLinear
        self.in_proj_ba: ColumnParallelLinear
        if split:
            self.in_proj_qkvz = SplitQKVZLinear(
                hidden,
                num_k * head_k,
                num_v * head_v,
                parallel,
                config.weight_format([f"{prefix}.in_proj_qkv", f"{prefix}.in_proj_z"], hidden),
            )
            self.in_proj_ba = MergedColumnParallelLinear(
                hidden,
                [num_v, num_v],
                False,
                parallel,
                config.weight_format([f"{prefix}.in_proj_b", f"{prefix}.in_proj_a"], hidden),
            )
        else:
            self.in_proj_qkvz = ColumnParallelLinear(
                hidden,
                num_k * (2 * head_k + 2 * self.ratio * head_v),
                False,
                parallel,
                config.weight_format([f"{prefix}.in_proj_qkvz"], hidden),
            )
            self.in_proj_ba = ColumnParallelLinear(
                hidden,
                num_k * 2 * self.ratio,
                False,
                parallel,
                config.weight_format([f"{prefix}.in_proj_ba"], hidden),
            )
        self.conv1d = DepthwiseConv(spec, parallel)
        first = parallel.tp_rank * self.v_heads
        self.dt_bias = head_param(first, self.v_heads, 1)
        self.A_log = head_param(first, self.v_heads, 1)
        gate = str(config.raw.get("output_gate_type") or "silu")  # Qwen4-Exp may say sigmoid
        self.norm = GatedRMSNorm(head_v, config.rms_norm_eps, gate)
        value_local = self.v_heads * head_v
        self.out_proj = RowParallelLinear(
            num_v * head_v,
            hidden,
            False,
            parallel,
            weight_format=config.weight_format(
                [f"{prefix}.out_proj"], value_local, first * head_v, num_v * head_v
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
            self._kernels = select_gated_delta(hidden.device)
        tokens = hidden.shape[0]
        hv, dv = self.v_heads, self.spec.head_v_dim
        mixed, z, b, a = self._project(hidden)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        out = hidden.new_empty(tokens, hv, dv)
        self.run_rows(rows, mixed, g, beta, out)
        gated = self.norm(out, z.reshape(tokens, hv, dv))
        return self.out_proj(gated.reshape(tokens, hv * dv))

    def _project(
        self, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The conv's input [T, conv_dim] (channels [q | k | v]), the output gate z [T, Hv * dv],
        and b, a [T, Hv], in value-head order."""
        tokens = hidden.shape[0]
        spec, hk, hv, r = self.spec, self.k_heads, self.v_heads, self.ratio
        dk, dv = spec.head_k_dim, spec.head_v_dim
        if self.split:
            mixed, z = self.in_proj_qkvz(hidden).split([spec.conv_dim, hv * dv], dim=-1)
            b, a = self.in_proj_ba(hidden).split([hv, hv], dim=-1)
            return mixed, z, b, a
        qkvz = self.in_proj_qkvz(hidden).view(tokens, hk, 2 * dk + 2 * r * dv)
        q, k, v, z = torch.split(qkvz, [dk, dk, r * dv, r * dv], dim=-1)
        mixed = torch.cat((q.reshape(tokens, -1), k.reshape(tokens, -1), v.reshape(tokens, -1)), -1)
        b, a = torch.split(self.in_proj_ba(hidden).view(tokens, hk, 2 * r), [r, r], dim=-1)
        return mixed, z.reshape(tokens, hv * dv), b.reshape(tokens, hv), a.reshape(tokens, hv)

    def _heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The convolved [B, T, conv_dim] as q, k [B, T, Hk, dk] and v [B, T, Hv, dv]."""
        batch, length = x.shape[:2]
        spec, hk = self.spec, self.k_heads
        key = hk * spec.head_k_dim
        q, k, v = torch.split(x, [key, key, self.v_heads * spec.head_v_dim], dim=-1)
        return (
            q.reshape(batch, length, hk, spec.head_k_dim),
            k.reshape(batch, length, hk, spec.head_k_dim),
            v.reshape(batch, length, self.v_heads, spec.head_v_dim),
        )
