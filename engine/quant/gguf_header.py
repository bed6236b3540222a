"""A GGUF file's header: its metadata (decoded on demand) and its tensors' names, types, shapes
and bytes (zero-copy views of a copy-on-write memory map), by gguf-py's own constants.

Why not gguf-py's `GGUFReader`: it decodes every metadata value into numpy parts up front, and a
tokenizer's vocabulary and merges (SmolLM2: 49,152 + 48,900 strings) took it 3.0 s per file on
this 2-core machine (5.4 s with the other core busy) for the few keys dgpp reads; loading a GGUF
opens it twice. This reads the same header in 0.05 s (`tests/engine/quant/test_gguf_header.py`
checks it against `GGUFReader` field by field and tensor by tensor).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from gguf import GGMLQuantizationType, GGUFValueType

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32


@cache
def _gguf() -> ModuleType:
    """gguf-py, for its constants: imported when a GGUF file is first read, so the engine
    imports on a machine without it (one that serves safetensors checkpoints only)."""
    import gguf

    return gguf


@cache
def _scalars() -> dict[Any, str]:
    kinds = _gguf().GGUFValueType
    return {
        kinds.UINT8: "<B",
        kinds.INT8: "<b",
        kinds.UINT16: "<H",
        kinds.INT16: "<h",
        kinds.UINT32: "<I",
        kinds.INT32: "<i",
        kinds.FLOAT32: "<f",
        kinds.BOOL: "<?",
        kinds.UINT64: "<Q",
        kinds.INT64: "<q",
        kinds.FLOAT64: "<d",
    }


class GgufFormatError(ValueError):
    """The file is no GGUF file dgpp can read (the message says where it stops making sense)."""


@dataclass(frozen=True)
class HeaderField:
    """One metadata value: its type and where its bytes lie (`start`..`end`)."""

    type: GGUFValueType
    item_type: GGUFValueType | None  # an array's
    count: int  # an array's length (1 otherwise)
    start: int  # the value's first byte (an array's: its first item)
    end: int


@dataclass(frozen=True)
class HeaderTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: the fastest-varying dimension first
    data: np.ndarray  # its bytes, uint8


class GgufHeader:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.buffer = np.memmap(path, dtype=np.uint8, mode="c")
        self._bytes = memoryview(self.buffer)
        if bytes(self._bytes[:4]) != MAGIC:
            raise GgufFormatError("no GGUF magic at the start")
        try:
            self._read()
        except struct.error:
            raise GgufFormatError(
                "the header runs past the end of the file (a truncated file?)"
            ) from None

    def _read(self) -> None:
        version, tensor_count, kv_count = struct.unpack_from("<IQQ", self._bytes, 4)
        if version not in (2, 3):
            raise GgufFormatError(f"GGUF version {version} (dgpp reads 2 and 3)")
        offset = 24
        self.fields: dict[str, HeaderField] = {}
        for _ in range(kv_count):
            key, offset = self._string(offset)
            (kind,) = struct.unpack_from("<I", self._bytes, offset)
            self.fields[key], offset = self._field(_gguf().GGUFValueType(kind), offset + 4)
        infos = []
        for _ in range(tensor_count):
            name, offset = self._string(offset)
            (dims,) = struct.unpack_from("<I", self._bytes, offset)
            shape = struct.unpack_from(f"<{dims}Q", self._bytes, offset + 4)
            kind, start = struct.unpack_from("<IQ", self._bytes, offset + 4 + 8 * dims)
            offset += 4 + 8 * dims + 12
            infos.append((name, _gguf().GGMLQuantizationType(kind), tuple(shape), start))
        alignment = int(self.field("general.alignment", DEFAULT_ALIGNMENT)) or DEFAULT_ALIGNMENT
        data_start = -(-offset // alignment) * alignment
        self.tensors = [self._tensor(*info, data_start) for info in infos]

    def field(self, key: str, default: Any = None) -> Any:
        """The value of `key` (a list for an array), or `default`."""
        entry = self.fields.get(key)
        if entry is None:
            return default
        if entry.type != _gguf().GGUFValueType.ARRAY:
            return self._value(entry.type, entry.start)[0]
        assert entry.item_type is not None
        values, offset = [], entry.start
        for _ in range(entry.count):
            value, offset = self._value(entry.item_type, offset)
            values.append(value)
        return values

    def field_bytes(self, key: str) -> bytes:
        """A field's value as it is stored (a cache key for what is derived from it)."""
        entry = self.fields[key]
        return bytes(self._bytes[entry.start : entry.end])

    def _string(self, offset: int) -> tuple[str, int]:
        (length,) = struct.unpack_from("<Q", self._bytes, offset)
        end = offset + 8 + length
        if end > len(self._bytes):
            raise GgufFormatError(f"a string at byte {offset} runs past the end of the file")
        return bytes(self._bytes[offset + 8 : end]).decode("utf-8", "replace"), end

    def _value(self, kind: GGUFValueType, offset: int) -> tuple[Any, int]:
        if kind == _gguf().GGUFValueType.STRING:
            return self._string(offset)
        fmt = _scalars().get(kind)
        if fmt is None:
            raise GgufFormatError(f"a nested array at byte {offset}")
        return struct.unpack_from(fmt, self._bytes, offset)[0], offset + struct.calcsize(fmt)

    def _field(self, kind: GGUFValueType, offset: int) -> tuple[HeaderField, int]:
        if kind != _gguf().GGUFValueType.ARRAY:
            _, end = self._value(kind, offset)
            return HeaderField(kind, None, 1, offset, end), end
        item, count = struct.unpack_from("<IQ", self._bytes, offset)
        item_type, start = _gguf().GGUFValueType(item), offset + 12
        if item_type == _gguf().GGUFValueType.STRING:  # walk the lengths, decode nothing
            end = start
            for _ in range(count):
                (length,) = struct.unpack_from("<Q", self._bytes, end)
                end += 8 + length
        elif item_type in _scalars():
            end = start + count * struct.calcsize(_scalars()[item_type])
        else:
            raise GgufFormatError(f"an array of {item_type.name} at byte {offset}")
        if end > len(self._bytes):
            raise GgufFormatError(f"an array at byte {offset} runs past the end of the file")
        return HeaderField(kind, item_type, count, start, end), end

    def _tensor(
        self,
        name: str,
        kind: GGMLQuantizationType,
        shape: tuple[int, ...],
        start: int,
        data_start: int,
    ) -> HeaderTensor:
        block, type_size = _gguf().GGML_QUANT_SIZES[kind]
        elements = int(np.prod(shape)) if shape else 1
        begin = data_start + start
        nbytes = elements // block * type_size
        if begin + nbytes > len(self.buffer):
            raise GgufFormatError(
                f"tensor {name} ({kind.name}, {nbytes} bytes) ends "
                f"{begin + nbytes - len(self.buffer)} bytes past the end of the file "
                "(a truncated file?)"
            )
        return HeaderTensor(name, kind, shape, self.buffer[begin : begin + nbytes])
