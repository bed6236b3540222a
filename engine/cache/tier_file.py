"""One prefix-cache block on disk: a header that names it and a payload of its bytes on one rank.

A file is the magic, the block's key and its parent's (0 for a first block), its token ids (on
rank 0, which decides hits; other ranks write none), the payload's length and CRC-32, and the
header's own CRC-32; then the payload, every cache pool's slice of the block in pool order. A
file that is short, long, foreign or fails either checksum is refused with the reason, never
read into a cache.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

MAGIC = b"DGPPKV01"
_FIXED = struct.Struct("<8sqqIQI")  # magic, key, parent, tokens, payload bytes, payload CRC
_CRC = struct.Struct("<I")
SUFFIX = ".kv"


class BlockFileError(Exception):
    """A block file that cannot be used (the message says why)."""


@dataclass(frozen=True)
class BlockHeader:
    key: int
    parent: int
    tokens: tuple[int, ...]
    payload_bytes: int
    payload_crc: int

    @property
    def header_bytes(self) -> int:
        return _FIXED.size + 4 * len(self.tokens) + _CRC.size

    @property
    def file_bytes(self) -> int:
        return self.header_bytes + self.payload_bytes


def file_bytes(payload_bytes: int, num_tokens: int) -> int:
    """The size of a block file with `num_tokens` token ids in its header."""
    return _FIXED.size + 4 * num_tokens + _CRC.size + payload_bytes


def file_name(key: int) -> str:
    return f"{key & 0xFFFFFFFFFFFFFFFF:016x}{SUFFIX}"


def encode_header(
    key: int, parent: int, tokens: Sequence[int], payload: Sequence[memoryview]
) -> bytes:
    crc = 0
    for part in payload:
        crc = zlib.crc32(part, crc)
    size = sum(part.nbytes for part in payload)
    head = _FIXED.pack(MAGIC, key, parent, len(tokens), size, crc)
    head += struct.pack(f"<{len(tokens)}i", *tokens)
    return head + _CRC.pack(zlib.crc32(head))


def write_block(
    path: Path, key: int, parent: int, tokens: Sequence[int], payload: Sequence[memoryview]
) -> int:
    """Write the block file at `path` (mode 0600) through a temporary name, so a reader never
    sees half a file under the real one; the bytes written."""
    head = encode_header(key, parent, tokens, payload)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(head)
            for part in payload:
                file.write(part)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return len(head) + sum(part.nbytes for part in payload)


def _read_header(file: BinaryIO) -> BlockHeader:
    """The checked header at the start of `file` (left positioned at the payload), its size
    checked against the file's."""
    data = file.read(_FIXED.size)
    if len(data) < _FIXED.size:
        raise BlockFileError("shorter than a header")
    magic, key, parent, num_tokens, size, crc = _FIXED.unpack(data)
    if magic != MAGIC:
        raise BlockFileError("not a dgpp block file (or another format version)")
    if num_tokens > 1 << 16:
        raise BlockFileError("its header is corrupt")
    rest = file.read(4 * num_tokens + _CRC.size)
    if len(rest) < 4 * num_tokens + _CRC.size:
        raise BlockFileError("its header is truncated")
    (header_crc,) = _CRC.unpack_from(rest, 4 * num_tokens)
    if zlib.crc32(rest[: 4 * num_tokens], zlib.crc32(data)) != header_crc:
        raise BlockFileError("its header fails its checksum")
    header = BlockHeader(key, parent, struct.unpack_from(f"<{num_tokens}i", rest), size, crc)
    if os.fstat(file.fileno()).st_size != header.file_bytes:
        raise BlockFileError("its size disagrees with its header (truncated?)")
    return header


def read_header(path: Path) -> BlockHeader:
    """The checked header of the file at `path`."""
    with open(path, "rb") as file:
        return _read_header(file)


def read_payload(path: Path, key: int, payload_bytes: int) -> bytearray:
    """The payload of block `key` from `path`, checked against the header's length and CRC."""
    with open(path, "rb") as file:
        header = _read_header(file)
        if header.key != key:
            raise BlockFileError("it holds another block")
        if header.payload_bytes != payload_bytes:
            found = header.payload_bytes
            raise BlockFileError(f"its payload is {found} bytes, not {payload_bytes}")
        payload = bytearray(payload_bytes)
        if file.readinto(payload) != payload_bytes:
            raise BlockFileError("its payload is truncated")
    if zlib.crc32(payload) != header.payload_crc:
        raise BlockFileError("its payload fails its checksum")
    return payload
