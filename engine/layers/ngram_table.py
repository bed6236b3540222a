"""Qwen4-Exp's PLE n-gram tables, kept on disk: each layer's table (tens of millions of rows,
up to ~90 GiB in the release) is memory-mapped from the checkpoint's safetensors shards and
read by row per token, never loaded whole into device (or host) memory; pages the lookups
touch stay in the OS page cache. `in_memory` reads it whole into host RAM instead (the
`ngram_tables_in_memory` knob), for machines whose disk is too slow for per-token reads.

The checkpoint stores a table as `...ngram_embedding.shard_{i}.weight`, `split_ngram_parts`
slices of its rows in order (transformers concatenates them at load).
"""

from __future__ import annotations

import json
import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from dgpp.engine.errors import ModelLoadError

_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
}
_SHARD = re.compile(r"^(?P<table>.+\.ngram_embedding)\.shard_(?P<index>\d+)\.weight$")


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
                tables.setdefault(match["table"], {})[int(match["index"])] = extent
    return {name: [shards[i] for i in sorted(shards)] for name, shards in tables.items()}


def open_tables(checkpoint: Path, in_memory: bool = False) -> dict[str, NgramTable]:
    """Every n-gram table of the checkpoint by module name, each file mapped once."""
    maps: dict[Path, mmap.mmap] = {}
    shards = table_shards(checkpoint)
    return {name: NgramTable(parts, in_memory, maps) for name, parts in shards.items()}


class NgramTable:
    """One layer's table [rows, dim] over its shards, mapped (or read into RAM)."""

    def __init__(
        self,
        shards: list[TensorExtent],
        in_memory: bool = False,
        maps: dict[Path, mmap.mmap] | None = None,
    ) -> None:
        if not shards:
            raise ModelLoadError("an n-gram table without shards")
        dims = {extent.shape[1] for extent in shards if len(extent.shape) == 2}
        if len(dims) != 1 or any(len(extent.shape) != 2 for extent in shards):
            raise ModelLoadError("n-gram table shards of different widths")
        self.dim = dims.pop()
        maps = {} if maps is None else maps
        self.parts = [self._open(extent, in_memory, maps) for extent in shards]
        self.starts = [0]
        for part in self.parts:
            self.starts.append(self.starts[-1] + part.shape[0])
        self._starts = torch.tensor(self.starts[1:-1], dtype=torch.int64)

    @property
    def num_rows(self) -> int:
        return self.starts[-1]

    @property
    def nbytes(self) -> int:
        return sum(part.numel() * part.element_size() for part in self.parts)

    @staticmethod
    def _open(extent: TensorExtent, in_memory: bool, maps: dict[Path, mmap.mmap]) -> torch.Tensor:
        data: bytearray | mmap.mmap
        if in_memory:
            with extent.file.open("rb") as handle:
                handle.seek(extent.offset)
                data = bytearray(handle.read(extent.length))
        else:
            data = maps.get(extent.file)  # type: ignore[assignment]
            if data is None:
                with extent.file.open("rb") as handle:
                    # Private, copy-on-write: nothing is written, so no page is ever copied;
                    # only the pages the lookups touch are read (and count as resident).
                    data = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
                maps[extent.file] = data
        offset = 0 if in_memory else extent.offset
        count = extent.length // extent.dtype.itemsize
        flat = torch.frombuffer(data, dtype=extent.dtype, count=count, offset=offset)
        return flat.view(extent.shape)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows [*ids.shape, dim] for table row ids (any shape, any device), on the host."""
        flat = ids.reshape(-1).to("cpu", torch.int64)
        if len(self.parts) == 1:
            return self.parts[0][flat].view(*ids.shape, self.dim)
        part = torch.bucketize(flat, self._starts, right=True)
        out = torch.empty(flat.shape[0], self.dim, dtype=self.parts[0].dtype)
        for index in part.unique().tolist():
            chosen = (part == index).nonzero().squeeze(1)
            out[chosen] = self.parts[index][flat[chosen] - self.starts[index]]
        return out.view(*ids.shape, self.dim)
