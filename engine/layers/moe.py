"""The mixture-of-experts block: a replicated router picks each token's top-k experts, the
experts run on the tokens routed to them only (grouped by expert: one batched product per expert
that has tokens), shared experts are added, and one all-reduce joins the ranks.

Tensor parallel: every rank holds a slice of every expert's intermediate dimension (gate/up rows,
down columns), so the block's partial sums add up like a row-parallel MLP's. Expert weights are
stacked at load into [E, 2 * I_local, H] (gate rows, then up rows) and [E, H, I_local] tensors,
from per-expert checkpoint tensors (`experts.{e}.gate_proj.weight`, ...) or from gpt-oss's fused
[E, H, 2 * I] layout (gate and up interleaved). `Experts.forward` runs `kernels.fused_moe`: the
fused Triton kernel on CUDA (all experts in two grouped GEMMs, no host synchronisation), its
PyTorch twin elsewhere (one batched product per expert that has tokens).

Quantized experts (GPTQ, AWQ, FP8, NVFP4 ... checkpoints, one module per expert) stay packed:
`PackedExperts` keeps each expert as a gate/up + down pair of packed linears (their loaders,
kernels and memory as for any other layer) and runs the same grouping over them.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from dgpp.engine.configuration.parallel import ParallelContext
from dgpp.engine.layers.moe_spec import MoeSpec
from dgpp.engine.layers.router import Router
from dgpp.kernels.dispatch import FUSED_MOE, uses_triton
from dgpp.kernels.fused_moe import fused_moe
from dgpp.kernels.fused_moe_torch import grouped_by_expert, moe_activation

_EXPERT_NAME = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_PROJECTION = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def expert_target(name: str) -> tuple[str, tuple[int, int]] | None:
    """A per-expert checkpoint tensor's stacked parameter and (expert, part): gate 0, up 1,
    down 0; None for every other name."""
    found = _EXPERT_NAME.match(name)
    if found is None:
        return None
    stem, expert, projection = found.groups()
    fused, part = _PROJECTION.get(projection, ("down_proj", 0))
    return f"{stem}.{fused}", (int(expert), part)


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape), requires_grad=False)


class Experts(nn.Module):
    """This rank's slice of every routed expert, stacked."""

    @property
    def host_sync(self) -> bool:
        """The PyTorch path counts each expert's tokens on the host (no CUDA graphs); the fused
        Triton kernel, which CUDA weights use, does not."""
        return not uses_triton(self.down_proj, FUSED_MOE)

    def __init__(self, spec: MoeSpec, hidden_size: int, parallel: ParallelContext) -> None:
        super().__init__()
        self.spec = spec
        num_experts = spec.router.num_experts
        self.num_experts = num_experts
        self.local = parallel.shard(spec.intermediate_size, "moe_intermediate_size")
        self.start = parallel.tp_rank * self.local
        self.gate_up_proj = _param(num_experts, 2 * self.local, hidden_size)
        self.down_proj = _param(num_experts, hidden_size, self.local)
        self.gate_up_proj.weight_loader = self.load_gate_up  # type: ignore[attr-defined]
        self.down_proj.weight_loader = self.load_down  # type: ignore[attr-defined]
        self.gate_up_proj_bias: nn.Parameter | None = None
        self.down_proj_bias: nn.Parameter | None = None
        if spec.expert_bias:
            self.gate_up_proj_bias = _param(num_experts, 2 * self.local)
            self.down_proj_bias = _param(num_experts, hidden_size)  # added once, after the sum
            self.gate_up_proj_bias.weight_loader = self.load_gate_up  # type: ignore[attr-defined]

    def _own(self, rows: torch.Tensor, dim: int) -> torch.Tensor:
        return rows.narrow(dim, self.start, self.local)

    def load_gate_up(
        self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple[int, int] | None = None
    ) -> None:
        """Expert e's gate (part 0) or up (part 1) [I, H]; or, without a shard, gpt-oss's
        fused tensor for every expert: weights [E, H, 2I], biases [E, 2I], gate/up interleaved."""
        local = self.local
        if shard is not None:
            expert, part = shard
            param.data[expert, part * local : (part + 1) * local].copy_(self._own(loaded, 0))
            return
        fused = loaded.transpose(1, 2) if loaded.dim() == 3 else loaded  # [E, 2I, (H)]
        param.data[:, :local].copy_(self._own(fused[:, 0::2], 1))
        param.data[:, local:].copy_(self._own(fused[:, 1::2], 1))

    def load_down(
        self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple[int, int] | None = None
    ) -> None:
        """Expert e's down [H, I]; or, without a shard, gpt-oss's [E, I, H] for every expert."""
        if shard is not None:
            param.data[shard[0]].copy_(self._own(loaded, 1))
            return
        param.data.copy_(self._own(loaded.transpose(1, 2), 2))

    def _activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        spec = self.spec
        return moe_activation(gate_up, spec.activation, spec.swiglu_alpha, spec.swiglu_limit)

    def forward(
        self, hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """hidden [T, H], routing weights and expert ids [T, k] -> this rank's partial sum of
        the weighted expert outputs [T, H] (biases of the down projection not included)."""
        spec = self.spec
        return fused_moe(
            hidden, self.gate_up_proj, self.down_proj, weights, ids,
            spec.activation, spec.swiglu_alpha, spec.swiglu_limit, self.gate_up_proj_bias,
        )  # fmt: skip

    def bias_term(self, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The routing-weighted down-projection biases [T, H] (gpt-oss), added after the sum."""
        assert self.down_proj_bias is not None
        chosen = self.down_proj_bias[ids]  # [T, k, H]
        return (weights.unsqueeze(-1).to(chosen.dtype) * chosen).sum(dim=1)


class PackedExperts(nn.ModuleList):
    """Routed experts that keep their checkpoint's quantized form: `self[e]` is expert e's
    slice as an MLP with packed linears and a non-reducing `partial(x)` (the checkpoint's own
    per-expert names load into it unchanged)."""

    down_proj_bias = None
    host_sync = True  # as `Experts`

    def forward(
        self, hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        return grouped_by_expert(
            hidden, weights, ids, len(self), lambda e, rows: self[e].partial(rows)
        )


class SparseMoeBlock(nn.Module):
    """router -> top-k -> routed experts (+ shared experts) -> one all-reduce.

    `router_name` is the checkpoint's name for the gate (`gate`; gpt-oss: `router`); `shared`
    is the shared-expert MLP (its `partial(x)` must not reduce), or None; `experts` the routed
    experts when the checkpoint keeps them quantized (`PackedExperts`, gpt-oss's MXFP4), else
    they are stacked dense `Experts`. With `shared_gate` (Qwen2-MoE, Qwen3-Next) the shared
    expert is named `shared_expert` and scaled per token by sigmoid(`shared_expert_gate`(x)), a
    replicated [1, hidden] projection; the scale applies to each rank's partial sum alike."""

    def __init__(
        self,
        spec: MoeSpec,
        hidden_size: int,
        parallel: ParallelContext,
        shared: nn.Module | None = None,
        router_name: str = "gate",
        experts: nn.Module | None = None,
        shared_gate: bool = False,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.router_name = router_name
        self.add_module(router_name, Router(spec.router, hidden_size))
        self.experts = experts if experts is not None else Experts(spec, hidden_size, parallel)
        self.shared_name = "shared_expert" if shared_gate else "shared_experts"
        self.add_module(self.shared_name, shared)
        self.shared_expert_gate = (
            nn.Linear(hidden_size, 1, bias=False).requires_grad_(False) if shared_gate else None
        )

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """`input_ids`: the step's tokens, for a hash router (DeepSeek-V4)."""
        weights, ids = self._modules[self.router_name](hidden, input_ids)  # [T, k] each
        out = self.experts(hidden, weights, ids)
        shared = self._modules[self.shared_name]
        if shared is not None:
            shared_out = shared.partial(hidden)
            if self.shared_expert_gate is not None:
                shared_out = torch.sigmoid(self.shared_expert_gate(hidden)) * shared_out
            out = out + shared_out
        out = self.parallel.all_reduce(out)
        if self.experts.down_proj_bias is not None:
            out = out + self.experts.bias_term(weights, ids)
        return out
