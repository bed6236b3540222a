"""gpt-oss's routed experts kept in the checkpoint's MXFP4 form: e2m1 codes (two per byte, the
even column in the low nibble) in blocks of 32 columns, one power-of-two (E8M0) scale per block.

The tensors are the checkpoint's own, stacked per layer: `gate_up_proj_blocks` [E, 2I, H/32, 16]
and `down_proj_blocks` [E, H, I/32, 16] (rows are output features; gate and up rows interleaved),
`*_scales` [E, rows, groups]. Each rank keeps its slice of every expert's intermediate dimension
(gate/up rows, down column blocks, which must fall on 32-column boundaries). Scales are held as
the bit patterns of their bfloat16 values (exact: bfloat16 has float32's exponent range), the
form `kernels.group_linear` multiplies by; each expert's product runs through that kernel.
"""

from __future__ import annotations

import torch
from torch import nn

from dgpp.engine.configuration.parallel import ParallelContext
from dgpp.engine.errors import ModelLoadError
from dgpp.engine.layers.moe import Experts, grouped_by_expert
from dgpp.engine.layers.moe_spec import MoeSpec
from dgpp.kernels.group_codes import GroupFormat, GroupWeight
from dgpp.kernels.group_linear import select_group_linear
from dgpp.kernels.group_linear_torch import GroupLinearFn

MXFP4 = GroupFormat("e2m1", 32, scale_dtype="bfloat16")
BLOCK = 32  # columns per scale
BLOCK_BYTES = BLOCK // 2


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)


def e8m0_bits(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 exponents (uint8, 2**(e - 127)) as the int16 bits of the bfloat16 scale."""
    values = torch.exp2(scales.to(torch.float32) - 127.0).to(torch.bfloat16)
    return values.view(torch.int16)


class Mxfp4Experts(Experts):
    """`Experts` with MXFP4 weights: the same biases, activation, grouping and shard rule."""

    host_sync = True  # grouped by expert on the host (`grouped_by_expert`) on every device

    def __init__(self, spec: MoeSpec, hidden_size: int, parallel: ParallelContext) -> None:
        super().__init__(spec, hidden_size, parallel)
        if hidden_size % BLOCK or self.local % BLOCK:
            raise ModelLoadError(
                f"MXFP4 experts need hidden_size ({hidden_size}) and each rank's expert width "
                f"({self.local}) to be multiples of {BLOCK}"
            )
        num_experts, local = self.num_experts, self.local
        del self.gate_up_proj, self.down_proj  # the dense stacks are not kept
        self.gate_up_proj_blocks = _param(
            num_experts, 2 * local, hidden_size // BLOCK, BLOCK_BYTES, dtype=torch.uint8
        )
        self.gate_up_proj_scales = _param(
            num_experts, 2 * local, hidden_size // BLOCK, dtype=torch.int16
        )
        self.down_proj_blocks = _param(
            num_experts, hidden_size, local // BLOCK, BLOCK_BYTES, dtype=torch.uint8
        )
        self.down_proj_scales = _param(num_experts, hidden_size, local // BLOCK, dtype=torch.int16)
        for name in ("gate_up_proj_blocks", "gate_up_proj_scales"):
            getattr(self, name).weight_loader = self.load_gate_up_rows  # type: ignore[attr-defined]
        for name in ("down_proj_blocks", "down_proj_scales"):
            getattr(self, name).weight_loader = self.load_down_blocks  # type: ignore[attr-defined]
        self._kernel: GroupLinearFn | None = None

    @staticmethod
    def _stored(param: nn.Parameter, loaded: torch.Tensor) -> torch.Tensor:
        return e8m0_bits(loaded) if param.dtype == torch.int16 else loaded

    def load_gate_up_rows(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """This rank's gate rows then up rows of every expert, from interleaved rows."""
        local, stored = self.local, self._stored(param, loaded)
        param.data[:, :local].copy_(self._own(stored[:, 0::2], 1))
        param.data[:, local:].copy_(self._own(stored[:, 1::2], 1))

    def load_down_blocks(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """This rank's column blocks of every expert's down projection."""
        start, count = self.start // BLOCK, self.local // BLOCK
        param.data.copy_(self._stored(param, loaded).narrow(2, start, count))

    @staticmethod
    def _weight(blocks: torch.Tensor, scales: torch.Tensor) -> GroupWeight:
        return GroupWeight(blocks.flatten(-2), scales.view(torch.bfloat16))

    def _expert(self, index: int, rows: torch.Tensor) -> torch.Tensor:
        gate_up = self._weight(self.gate_up_proj_blocks[index], self.gate_up_proj_scales[index])
        down = self._weight(self.down_proj_blocks[index], self.down_proj_scales[index])
        if self._kernel is None:  # chosen once, on the device the weights live on
            self._kernel = select_group_linear(gate_up, MXFP4)
        inner = self._kernel(rows, gate_up, MXFP4)
        if self.gate_up_proj_bias is not None:
            inner = inner + self.gate_up_proj_bias[index]
        return self._kernel(self._activate(inner), down, MXFP4)

    def forward(
        self, hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        return grouped_by_expert(hidden, weights, ids, self.num_experts, self._expert)
