"""Tile sizes of the fused MoE kernel, from a small table per GPU architecture (no autotuning
while serving), each within the architecture's shared memory per block.

GB10 (DGX Spark, sm_121) and the other sm_12x parts have about 99 KiB of shared memory per
block, far less than Hopper's 227 KiB: tile configs tuned for H100 overflow it. A config's need
is its pipelined operand tiles: the gate/up kernel's [BM, BK] rows and two [BK, BN] weight
tiles (gate and up), times the stages.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

KIB = 1024


@dataclass(frozen=True)
class MoeTiles:
    block_m: int  # routed rows per block (one expert's)
    block_n: int  # output columns per program
    block_k: int  # reduction step
    num_warps: int
    num_stages: int

    def shared_bytes(self, element_bytes: int) -> int:
        per_stage = self.block_m * self.block_k + 2 * self.block_k * self.block_n
        return per_stage * element_bytes * self.num_stages


# Shared memory per block, by compute-capability major version.
SHARED_LIMIT = {9: 227 * KIB, 12: 99 * KIB}
DEFAULT_SHARED_LIMIT = 99 * KIB  # other parts: the smallest of those dgpp serves on
# (most rows per expert on average, tiles) per architecture: decode-sized steps, a few rows per
# expert, take short row blocks (less padding); prefill-sized ones taller blocks.
TABLE: dict[int, tuple[tuple[int, MoeTiles], ...]] = {
    9: ((16, MoeTiles(16, 64, 128, 4, 4)), (1 << 62, MoeTiles(64, 128, 64, 8, 3))),
    12: ((16, MoeTiles(16, 64, 64, 4, 3)), (1 << 62, MoeTiles(64, 64, 64, 4, 2))),
}
DEFAULT_ARCH = 12


def architecture(device: torch.device) -> int:
    """The compute-capability major of a CUDA device; the default table's elsewhere."""
    if device.type != "cuda":
        return DEFAULT_ARCH
    return torch.cuda.get_device_capability(device)[0]


def moe_tiles(
    num_assignments: int, num_experts: int, device: torch.device, element_bytes: int
) -> MoeTiles:
    """The tiles for a step routing `num_assignments` token-expert pairs over `num_experts` on
    `device`, of operands of `element_bytes` each (the table is for 16-bit ones): fewer stages,
    then a shorter reduction step, until they fit the architecture's shared memory."""
    arch = architecture(device)
    per_expert = -(-num_assignments // num_experts)
    rows = TABLE.get(arch, TABLE[DEFAULT_ARCH])
    tiles = next(tiles for most, tiles in rows if per_expert <= most)
    limit = SHARED_LIMIT.get(arch, DEFAULT_SHARED_LIMIT)
    while tiles.shared_bytes(element_bytes) > limit:
        if tiles.num_stages > 2:
            tiles = replace(tiles, num_stages=tiles.num_stages - 1)
        else:
            assert tiles.block_k > 16, "even the smallest tiles overflow shared memory"
            tiles = replace(tiles, block_k=tiles.block_k // 2)
    return tiles
