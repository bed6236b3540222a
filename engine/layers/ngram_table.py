"""Qwen4-Exp's PLE n-gram tables, kept on disk: each layer's table (tens of millions of rows,
up to ~90 GiB in the release) stays in the checkpoint's safetensors shards and is read by row
per token (`os.preadv`, the file advised random), never loaded whole into device or host
memory. Rows the lookups read stay in the OS page cache, which the kernel may drop.

Why reads rather than a memory map: on kernels that keep the page cache in large folios
(Linux 6.x on ext4/xfs), a fault on a mapped row maps its whole folio, up to 2 MiB, so 200
random rows of a 128 MiB mapped table put ~130 MiB in the resident set here (measured, 6.18),
and a cold cache would read megabytes per row; a read of one row reads its pages only.

`in_memory` reads each table whole into host RAM instead (the `ngram_tables_in_memory` knob),
for machines whose disk is too slow for per-token reads; the memory plan counts it then.

The checkpoint stores a table as `...ngram_embedding.shard_{i}.weight`, `split_ngram_parts`
slices of its rows in order (transformers concatenates them at load), or whole.
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dgpp.engine.errors import ModelLoadError

_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
}
# `...ngram_embedding.shard_{i}.weight` as the releases store a table, or one tensor
# `...ngram_embedding.weight` (transformers' runtime name, what a re-export may write)
_SHARD = re.compile(r"^(?P<table>.+\.ngram_embedding)(\.shard_(?P<index>\d+))?\.weight$")


@dataclass(frozen=True)
class TensorExtent:
    """Where one tensor's bytes lie in a safetensors file."""

    file: Path
    offset: int
    length: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def safetensors_extents(path: Path) -> dict[str, TensorExtent]:
    """Every tensor of a safetensors file by name, from its header alone."""
    with path.open("rb") as handle:
        (size,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(size))
    found = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        begin, end = meta["data_offsets"]
        dtype = _DTYPES.get(meta["dtype"])
        if dtype is None:
            continue
        found[name] = TensorExtent(path, 8 + size + begin, end - begin, dtype, tuple(meta["shape"]))
    return found


def table_shards(checkpoint: Path) -> dict[str, list[TensorExtent]]:
    """Each n-gram table's shards, in row order, by the table's module name."""
    tables: dict[str, dict[int, TensorExtent]] = {}
    for file in sorted(checkpoint.glob("*.safetensors")):
        for name, extent in safetensors_extents(file).items():
            match = _SHARD.match(name)
            if match:
                tables.setdefault(match["table"], {})[int(match["index"] or 0)] = extent
    return {name: [shards[i] for i in sorted(shards)] for name, shards in tables.items()}


def open_tables(checkpoint: Path, in_memory: bool = False) -> dict[str, NgramTable]:
    """Every n-gram table of the checkpoint by module name."""
    return {name: NgramTable(parts, in_memory) for name, parts in table_shards(checkpoint).items()}


class _Part:
    """One shard: its rows in a file (read by row) or in memory."""

    def __init__(self, extent: TensorExtent, in_memory: bool) -> None:
        self.rows, self.dim = extent.shape
        self.dtype = extent.dtype
        self.row_bytes = self.dim * extent.dtype.itemsize
        self.offset = extent.offset
        self.data: torch.Tensor | None = None
        self.fd = -1
        if in_memory:
            with extent.file.open("rb") as handle:
                handle.seek(extent.offset)
                raw = bytearray(handle.read(extent.length))
            self.data = torch.frombuffer(raw, dtype=extent.dtype).view(self.rows, self.dim)
        else:
            self.fd = os.open(extent.file, os.O_RDONLY)
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)

    def read(self, rows: list[int]) -> torch.Tensor:
        """Rows [n, dim] of this shard (local row ids)."""
        if self.data is not None:
            return self.data[torch.tensor(rows, dtype=torch.int64)]
        buffer = np.empty(len(rows) * self.row_bytes, dtype=np.uint8)
        view, size = memoryview(buffer), self.row_bytes
        for index, row in enumerate(rows):
            target = view[index * size : (index + 1) * size]
            if os.preadv(self.fd, [target], self.offset + row * size) != size:
                raise ModelLoadError(f"short read of n-gram table row {row}")
        return torch.from_numpy(buffer).view(self.dtype).view(len(rows), self.dim)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class NgramTable:
    """One layer's table [rows, dim] over its shards, read by row (or held in RAM)."""

    def __init__(self, shards: list[TensorExtent], in_memory: bool = False) -> None:
        if not shards:
            raise ModelLoadError("an n-gram table without shards")
        if any(len(extent.shape) != 2 for extent in shards):
            raise ModelLoadError("n-gram table shards must be [rows, dim]")
        dims = {extent.shape[1] for extent in shards}
        if len(dims) != 1:
            raise ModelLoadError("n-gram table shards of different widths")
        self.dim = dims.pop()
        self.dtype = shards[0].dtype
        self.parts = [_Part(extent, in_memory) for extent in shards]
        self.starts = [0]
        for part in self.parts:
            self.starts.append(self.starts[-1] + part.rows)
        self._bounds = torch.tensor(self.starts[1:-1], dtype=torch.int64)

    @property
    def num_rows(self) -> int:
        return self.starts[-1]

    @property
    def nbytes(self) -> int:
        return self.num_rows * self.dim * self.dtype.itemsize

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows [*ids.shape, dim] for table row ids (any shape, any device), on the host;
        each distinct row read once."""
        flat = ids.reshape(-1).to("cpu", torch.int64)
        unique, inverse = torch.unique(flat, return_inverse=True)
        part_of = torch.bucketize(unique, self._bounds, right=True).tolist()
        found = torch.empty(unique.shape[0], self.dim, dtype=self.dtype)
        wanted: dict[int, list[int]] = {}
        for index, part in enumerate(part_of):
            wanted.setdefault(part, []).append(index)
        values = unique.tolist()
        for part, indices in wanted.items():
            local = [values[i] - self.starts[part] for i in indices]
            found[torch.tensor(indices)] = self.parts[part].read(local)
        return found[inverse].view(*ids.shape, self.dim)

    def __del__(self) -> None:
        for part in getattr(self, "parts", ()):
            part.close()
