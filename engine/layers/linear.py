"""Tensor-parallel linear layers; each parameter carries a `weight_loader` that takes the full
checkpoint tensor and copies this rank's shard into place.

A layer built with a `weight_format` keeps its weight packed: a GGML type (`quant.weight_formats`)
is a uint8 [rows, bytes] parameter of whole blocks, loaded from the checkpoint's raw rows (the same
row slicing; input columns are cut at block boundaries) and multiplied by `kernels.ggml_linear`;
a `GroupFormat` (GPTQ, AWQ, compressed-tensors, FP8, NVFP4, MXFP4: `quant.quant_schemes`) is
codes plus scales (`layers.group_weight`), loaded from a module's converted `GroupWeight` and
multiplied by `kernels.group_linear`."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dgpp.engine.configuration.parallel import ParallelContext
from dgpp.engine.layers.group_weight import (
    add_group_params,
    copy_group_columns,
    copy_group_rows,
    group_weight,
)
from dgpp.engine.layers.head_partition import partition_heads
from dgpp.kernels.ggml_blocks import FORMATS
from dgpp.kernels.ggml_linear import ggml_linear_cpu
from dgpp.kernels.group_codes import GroupFormat, GroupWeight
from dgpp.kernels.group_linear import select_group_linear
from dgpp.kernels.group_linear_torch import GroupLinearFn, group_linear_torch
from dgpp.kernels.linear import LinearFn, LinearPacker

WeightFormat = str | GroupFormat | None  # a GGML type, a group-quantized form, or dense


def _attach_loader(param: nn.Parameter, loader: object) -> None:
    param.weight_loader = loader  # type: ignore[attr-defined]


def _new_param(*shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def weight_param(rows: int, cols: int, weight_format: WeightFormat) -> nn.Parameter:
    """A [rows, cols] weight: dense, packed as `weight_format` blocks (uint8 [rows, bytes]), or
    a group-quantized form's codes (its scales: `add_group_params`)."""
    if weight_format is None:
        return _new_param(rows, cols)
    if isinstance(weight_format, GroupFormat):
        param = _new_param(rows, weight_format.code_bytes(cols), dtype=torch.uint8)
        param.weight_format = weight_format  # type: ignore[attr-defined]
        return param
    spec = FORMATS[weight_format]
    param = _new_param(rows, cols // spec.block_size * spec.type_size, dtype=torch.uint8)
    param.weight_format = weight_format  # type: ignore[attr-defined]  # what the loader reads
    return param


def _copy_rows(
    layer: nn.Module,
    param: nn.Parameter,
    loaded: torch.Tensor | GroupWeight,
    dst: int,
    src: int,
    size: int,
) -> None:
    """Rows src .. src + size of a checkpoint tensor (or a module's packed weight) into rows
    dst .. dst + size of `param`."""
    if isinstance(loaded, GroupWeight):
        copy_group_rows(layer, loaded, dst, src, size)
    else:
        param.data.narrow(0, dst, size).copy_(loaded.narrow(0, src, size))


def packed_columns(weight_format: str | None, start: int, size: int) -> tuple[int, int]:
    """Columns start .. start + size of a weight as (start, size) along its stored dim 1."""
    if weight_format is None:
        return start, size
    spec = FORMATS[weight_format]
    return start // spec.block_size * spec.type_size, size // spec.block_size * spec.type_size


class PackableLinear(nn.Module):
    """A linear layer whose matmul can be swapped, once weights are loaded, for a packed kernel.

    After `pack()` the dense weight is released (the packed copy is the only one kept), unless
    `keep_dense`: then packing may run on another thread while this layer serves, and the dense
    weight (memory-mapped from a resident image, so it costs no private memory) stays valid.
    """

    weight: nn.Parameter | None
    bias: nn.Parameter | None
    packed: LinearFn | None = None
    weight_format: WeightFormat = None
    in_features: int = 0
    group_kernel: GroupLinearFn = staticmethod(group_linear_torch)  # chosen in `select_kernels`

    def init_weight(self, rows: int, cols: int, weight_format: WeightFormat) -> None:
        self.weight_format, self.in_features = weight_format, cols
        self.weight = weight_param(rows, cols, weight_format)
        if isinstance(weight_format, GroupFormat):
            add_group_params(self, rows, cols, weight_format)

    def select_kernels(self) -> None:
        """Pick the group-quantized kernel for the device the weights are on (once)."""
        if isinstance(self.weight_format, GroupFormat):
            assert self.weight is not None
            self.group_kernel = select_group_linear(group_weight(self), self.weight_format)

    def pack(self, packer: LinearPacker, with_bias: bool = True, keep_dense: bool = False) -> None:
        if self.weight_format is not None:
            return  # already packed, in its checkpoint's blocks
        assert self.weight is not None and self.packed is None, "pack() called twice"
        self.packed = packer(self.weight.detach(), self.bias if with_bias else None)
        if not keep_dense:
            self.weight = None

    def matmul(self, x: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
        packed = self.packed  # read once: another thread may be packing this layer
        if packed is not None:
            return packed(x)
        bias = self.bias if with_bias else None
        if isinstance(self.weight_format, GroupFormat):
            y = self.group_kernel(x, group_weight(self), self.weight_format)
            return y if bias is None else y + bias
        if self.weight_format is not None:
            assert self.weight is not None
            y = ggml_linear_cpu(x, self.weight, self.weight_format, self.in_features)
            return y if bias is None else y + bias
        weight = self.weight
        if weight is not None and weight.dtype != x.dtype:  # 16-bit weights of the native step
            weight = weight.to(x.dtype)
        return F.linear(x, weight, bias)


class ColumnParallelLinear(PackableLinear):
    """Y = X W^T with W's output rows split across ranks; each rank returns its slice of Y."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        parallel: ParallelContext,
        weight_format: WeightFormat = None,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.output_size_local = parallel.shard(output_size, "output_size")
        self.init_weight(self.output_size_local, input_size, weight_format)
        _attach_loader(self.weight, self.load_rows)
        self.bias = _new_param(self.output_size_local) if bias else None
        if self.bias is not None:
            _attach_loader(self.bias, self.load_rows)

    def load_rows(self, param: nn.Parameter, loaded: torch.Tensor | GroupWeight) -> None:
        rows = param.shape[0]
        _copy_rows(self, param, loaded, 0, self.parallel.tp_rank * rows, rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul (gate/up).

    The checkpoint stores them separately; shard `i` of each rank's weight holds this rank's slice
    of projection `i`."""

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool,
        parallel: ParallelContext,
        weight_format: WeightFormat = None,
    ) -> None:
        self.output_sizes_local = [parallel.shard(size, "output_size") for size in output_sizes]
        super().__init__(input_size, sum(output_sizes), bias, parallel, weight_format)

    def load_rows(  # type: ignore[override]
        self, param: nn.Parameter, loaded: torch.Tensor | GroupWeight, shard_id: int
    ) -> None:
        size = self.output_sizes_local[shard_id]
        offset = sum(self.output_sizes_local[:shard_id])
        _copy_rows(self, param, loaded, offset, self.parallel.tp_rank * size, size)


class QKVParallelLinear(ColumnParallelLinear):
    """The fused query/key/value projection. Each rank holds whole key/value groups (see
    `partition_heads`), or one replicated key/value head when there are fewer than ranks.
    `query_factor` 2: each query head's rows are followed by as many of its output gate
    (Qwen3-Next's gated attention stores them interleaved per head in `q_proj`). `v_head_dim`:
    value heads narrower than query and key heads (MiMo-V2-Flash: 128 against 192)."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        parallel: ParallelContext,
        weight_format: WeightFormat = None,
        query_factor: int = 1,
        v_head_dim: int | None = None,
    ) -> None:
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim or head_dim
        self.query_factor = query_factor
        heads = partition_heads(num_heads, num_kv_heads, parallel.tp_size, parallel.tp_rank)
        self.heads = heads
        self.num_heads_local = heads.num_q
        self.num_kv_heads_local = heads.num_kv
        total_local = (query_factor * heads.num_q + heads.num_kv) * head_dim
        total_local += heads.num_kv * self.v_head_dim
        super().__init__(hidden_size, total_local * parallel.tp_size, bias, parallel, weight_format)

    def load_rows(  # type: ignore[override]
        self, param: nn.Parameter, loaded: torch.Tensor | GroupWeight, shard_id: str
    ) -> None:
        heads, head_dim = self.heads, self.head_dim
        q_size = heads.num_q * head_dim * self.query_factor
        kv_size = heads.num_kv * head_dim
        if shard_id == "q":
            offset, size, start = 0, q_size, heads.q_start * head_dim * self.query_factor
        elif shard_id == "k":
            offset, size, start = q_size, kv_size, heads.kv_start * head_dim
        else:
            v_dim = self.v_head_dim
            offset, size, start = q_size + kv_size, heads.num_kv * v_dim, heads.kv_start * v_dim
        _copy_rows(self, param, loaded, offset, start, size)


class RowParallelLinear(PackableLinear):
    """Y = X W^T with W's input columns split across ranks; partial products are summed over the
    group, so every rank returns the full Y. The bias is added once, after the sum."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        parallel: ParallelContext,
        input_range: tuple[int, int] | None = None,
        weight_format: WeightFormat = None,
    ) -> None:
        """`input_range` (start, size) gives this rank's input columns when the split is not
        even (attention heads, see `partition_heads`); by default they are split evenly."""
        super().__init__()
        self.parallel = parallel
        if input_range is None:
            size = parallel.shard(input_size, "input_size")
            input_range = (parallel.tp_rank * size, size)
        self.input_start, self.input_size_local = input_range
        self.init_weight(output_size, self.input_size_local, weight_format)
        _attach_loader(self.weight, self.load_columns)
        self.bias = _new_param(output_size) if bias else None

    def load_columns(self, param: nn.Parameter, loaded: torch.Tensor | GroupWeight) -> None:
        if isinstance(loaded, GroupWeight):
            copy_group_columns(self, loaded, self.input_start, self.input_size_local)
            return
        assert not isinstance(self.weight_format, GroupFormat)
        start, size = packed_columns(self.weight_format, self.input_start, self.input_size_local)
        param.data.copy_(loaded.narrow(1, start, size))

    def pack(self, packer: LinearPacker, with_bias: bool = False, keep_dense: bool = False) -> None:
        # The bias is added once, after the reduction.
        super().pack(packer, with_bias=False, keep_dense=keep_dense)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.parallel.all_reduce(self.matmul(x, with_bias=False))
        return y if self.bias is None else y + self.bias
