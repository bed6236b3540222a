"""The KV block pool: which fixed-size blocks are free, and each request's block table."""

from __future__ import annotations

from collections import deque

from dgpp.engine.request import Request


class BlockPool:
    """A free list of block ids with reference counts.

    Invariant: a block is in the free list exactly when its reference count is zero.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        """Take `count` free blocks, each with reference count 1; the caller checked they exist."""
        assert count <= len(self._free), "allocate() without enough free blocks"
        blocks = [self._free.popleft() for _ in range(count)]
        for block in blocks:
            self._ref_counts[block] = 1
        return blocks

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each block; blocks that reach zero return to the free list."""
        for block in reversed(blocks):
            self._ref_counts[block] -= 1
            assert self._ref_counts[block] >= 0, "block released more often than referenced"
            if self._ref_counts[block] == 0:
                self._free.append(block)


class BlockManager:
    """Grows and frees requests' block tables in a `BlockPool`."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.num_free_blocks

    def blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        total = request.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(request.block_table))

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Grow the block table to hold `num_new_tokens` more tokens; False if the pool is short."""
        needed = self.blocks_needed(request, num_new_tokens)
        if needed > self.pool.num_free_blocks:
            return False
        request.block_table.extend(self.pool.allocate(needed))
        return True

    def free(self, request: Request) -> None:
        self.pool.release(request.block_table)
        request.block_table = []
        request.num_computed_tokens = 0
