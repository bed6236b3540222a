"""Per-rank resident weight images: a restart maps its final tensors instead of re-reading the
checkpoint.

An image is one safetensors file holding a rank's tensors as `load_weights` leaves them (sharded,
q/k/v and gate/up fused, converted to the run dtype), before packing. It is named
`<model>-r<rank>of<world>-<dtype>-<digest16>.safetensors` after its `ImageKey`, a digest of the
checkpoint's identity (file names, sizes and mtimes, the content of config.json), the rank, world
size, dtype, device type, architecture and `LOADER_FORMAT_VERSION`; no weight shard is opened to
compute it. Tied parameters are stored once and re-tied on load; non-persistent buffers (rotary
tables) are not stored.

Invariants: an image appears under its final name only complete (temp file, fsync, `os.replace`),
and is never rewritten in place, so a process mapping an old image keeps valid pages. Writing never
fails a load. Every load checks the header, the file size and the exact names, shapes and dtypes;
the data checksum (CRC-32 over the tensors in name order) is checked by `verify_image` only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import struct
import tempfile
import time
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from dgpp.engine.checkpoint import loader
from dgpp.engine.errors import DgppError

# Bump whenever what `load_weights` produces for the same checkpoint changes (layout, fusion,
# padding): every existing image then misses and is rebuilt.
LOADER_FORMAT_VERSION = 1
IMAGE_FORMAT = "dgpp-resident-image"
KEY_FILE_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "*.gguf", "config.json")
MAX_HEADER_BYTES = 100 << 20
ST_DTYPES = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "I64": torch.int64,
    "I32": torch.int32,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
ST_NAMES = {dtype: name for name, dtype in ST_DTYPES.items()}
IMAGE_NAME = re.compile(r".-r\d+of\d+-[a-z0-9]+-[0-9a-f]{16}\.safetensors")

log = logging.getLogger(__name__)


class ResidentImageError(DgppError):
    """A path given to a cache command is not a resident image."""

    code = "resident_image_error"


class _Unusable(Exception):
    """An image that cannot be used; the message says why."""


@dataclass(frozen=True)
class ImageKey:
    """What a rank's image depends on; `digest` covers every field and the checkpoint's files."""

    digest: str  # sha256 hex
    model_name: str
    tp_rank: int
    tp_size: int
    dtype: str
    device_type: str
    architecture: str

    @property
    def file_name(self) -> str:
        model = re.sub(r"[^A-Za-z0-9._-]", "_", self.model_name) or "model"
        rank = f"r{self.tp_rank}of{self.tp_size}"
        return f"{model}-{rank}-{self.dtype}-{self.digest[:16]}.safetensors"


@dataclass(frozen=True)
class ImageInfo:
    """One file found in a cache directory: its header metadata, or why it could not be read."""

    path: Path
    size_bytes: int
    metadata: Mapping[str, str]
    problem: str | None = None


@dataclass(frozen=True)
class ImageCheck:
    """The outcome of a full verification; `problem` is None for a sound image."""

    path: Path
    problem: str | None

    @property
    def is_ok(self) -> bool:
        return self.problem is None


@dataclass(frozen=True)
class _Header:
    entries: Mapping[str, tuple[str, tuple[int, ...]]]  # name -> (safetensors dtype, shape)
    metadata: Mapping[str, str]


def image_key(
    checkpoint: Path,
    tp_rank: int,
    tp_size: int,
    dtype: str,
    device_type: str,
    architecture: str,
) -> ImageKey:
    """The key of this rank's image; reads only directory entries and config.json."""
    digest = hashlib.sha256()

    def field(name: str, value: bytes) -> None:  # length-prefixed, so fields cannot run together
        for part in (name.encode(), value):
            digest.update(len(part).to_bytes(8, "little") + part)

    field("loader_format", str(LOADER_FORMAT_VERSION).encode())
    files = sorted({file for pattern in KEY_FILE_PATTERNS for file in checkpoint.glob(pattern)})
    for file in files:
        stat = file.stat()
        field("file", f"{file.name}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    field("config", (checkpoint / "config.json").read_bytes())
    rank = f"{tp_rank}/{tp_size}\0{dtype}\0{device_type}\0{architecture}"
    field("rank", rank.encode())
    folder = checkpoint.resolve()  # a hub snapshot is named by its commit: name it by its repo
    name = folder.parent.parent.name if folder.parent.name == "snapshots" else folder.name
    return ImageKey(digest.hexdigest(), name, tp_rank, tp_size, dtype, device_type, architecture)


def load_resident(model: nn.Module, checkpoint: Path, key: ImageKey, root: Path) -> bool:
    """Fill `model` from its image under `root` (warm: True), or from the checkpoint and then
    write the image (cold: False). An unusable image is logged, removed and rebuilt."""
    start = time.perf_counter()
    image = root / key.file_name
    if load_image(model, image, key):
        elapsed = time.perf_counter() - start
        log.info("rank %d: weights warm from %s in %.2f s", key.tp_rank, image, elapsed)
        return True
    loader.load_weights(model, checkpoint)
    loaded = time.perf_counter()
    written = "written" if write_image(model, image, key, checkpoint) else "not written"
    log.info(
        "rank %d: weights cold from %s in %.2f s; image %s %s in %.2f s",
        key.tp_rank,
        checkpoint,
        loaded - start,
        image,
        written,
        time.perf_counter() - loaded,
    )
    return False


def load_image(model: nn.Module, image: Path, key: ImageKey) -> bool:
    """Assign the image's tensors (memory-mapped, not copied) into `model`; False when there is
    no usable image, after removing an unusable one."""
    if not image.is_file():
        return False
    tensors, aliases = _canonical_state(model)
    try:
        header = _read_header(image)
        if header.metadata.get("key") != key.digest:
            raise _Unusable("its key digest differs from this checkpoint's")
        expected = {name: (ST_NAMES[t.dtype], tuple(t.shape)) for name, t in tensors.items()}
        found = header.entries
        differing = sorted(n for n in {*found, *expected} if found.get(n) != expected.get(n))
        if differing:
            name = differing[0]
            raise _Unusable(
                f"{name} is {found.get(name)} there, the model expects {expected.get(name)}"
            )
        with safe_open(str(image), framework="pt", device="cpu") as handle:
            mapped = {name: handle.get_tensor(name) for name in expected}
    except (_Unusable, SafetensorError, OSError, KeyError, ValueError, RuntimeError) as err:
        log.warning("resident image %s is unusable (%s); loading the checkpoint", image, err)
        image.unlink(missing_ok=True)
        return False
    result = model.load_state_dict(mapped, strict=False, assign=True)
    assert not result.unexpected_keys and set(result.missing_keys) == set(aliases)
    for alias, canonical in aliases.items():
        owner, _, attribute = alias.rpartition(".")
        setattr(model.get_submodule(owner), attribute, model.get_parameter(canonical))
    return True


def write_image(model: nn.Module, image: Path, key: ImageKey, checkpoint: Path) -> bool:
    """Write `model`'s state as `image` atomically, then drop stale images. An OS or
    serialisation error is logged and reported as False, never raised."""
    tensors, aliases = _canonical_state(model)
    temp: str | None = None
    try:
        metadata = {
            "format": IMAGE_FORMAT,
            "loader_format": str(LOADER_FORMAT_VERSION),
            "key": key.digest,
            "checkpoint": str(checkpoint.resolve()),
            "model": key.model_name,
            "architecture": key.architecture,
            "tp_rank": str(key.tp_rank),
            "tp_size": str(key.tp_size),
            "dtype": key.dtype,
            "device_type": key.device_type,
            "dgpp_version": version("dgpp"),
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "num_tensors": str(len(tensors)),
            "aliases": json.dumps(aliases, sort_keys=True),
            "checksum": _checksum(tensors.items()),  # KeyError: a dtype safetensors lacks
        }
        image.parent.mkdir(parents=True, exist_ok=True)
        handle, temp = tempfile.mkstemp(prefix=f".{image.name}.", suffix=".tmp", dir=image.parent)
        os.close(handle)
        save_file(tensors, temp, metadata)
        with open(temp, "rb") as written:
            os.fsync(written.fileno())
        os.replace(temp, image)
        temp = None
        directory = os.open(image.parent, os.O_RDONLY)
        try:
            os.fsync(directory)  # make the rename itself durable
        finally:
            os.close(directory)
    except (OSError, SafetensorError, KeyError) as err:
        log.warning("cannot write resident image %s (%s); continuing without it", image, err)
        return False
    finally:
        if temp is not None:
            Path(temp).unlink(missing_ok=True)
    _remove_stale(image, metadata)
    return True


def list_images(root: Path) -> list[ImageInfo]:
    """Every `*.safetensors` file in `root`, with its header metadata (or why it is unreadable)."""
    found = []
    for path in sorted(root.glob("*.safetensors")):
        try:
            found.append(ImageInfo(path, path.stat().st_size, _read_header(path).metadata))
        except (_Unusable, OSError) as err:
            found.append(ImageInfo(path, 0, {}, str(err)))
    return found


def verify_image(path: Path) -> ImageCheck:
    """Check an image fully: its header, and the checksum of every tensor's bytes."""
    try:
        header = _read_header(path)
        expected = header.metadata.get("checksum")
        if expected is None:
            raise _Unusable("its header records no checksum")
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            names = list(handle.keys())
            actual = _checksum([(name, handle.get_tensor(name)) for name in names])
        if header.metadata.get("num_tensors") != str(len(names)):
            raise _Unusable("its tensor count differs from the header's num_tensors")
        if actual != expected:
            raise _Unusable(f"checksum mismatch: header {expected}, data {actual}")
    except (_Unusable, SafetensorError, OSError, ValueError, RuntimeError) as err:
        return ImageCheck(path, str(err))
    return ImageCheck(path, None)


def remove_images(root: Path, which: Sequence[Path] | None = None) -> list[Path]:
    """Delete the images `which` (all of `root`'s, and leftover temp files, when None); return
    what was deleted. Only images are ever deleted: a path among `which` that is not one raises
    `ResidentImageError` before anything is deleted."""
    if which is None:
        targets = [path for path in sorted(root.glob("*.safetensors")) if _is_image(path, root)]
        targets += sorted(root.glob(".*.safetensors.*.tmp"))
    else:
        targets = [Path(path) for path in which]
        strangers = [str(p) for p in targets if not (p.is_file() and _is_image(p, root))]
        if strangers:
            raise ResidentImageError(
                f"not dgpp resident images, so nothing was removed: {', '.join(strangers)}"
            )
    for path in targets:
        path.unlink(missing_ok=True)
    return targets


def _is_image(path: Path, root: Path) -> bool:
    """True for a file whose header carries the image format or, when its header is broken, for
    a file in `root` named like an image (a user's checkpoint shard never qualifies)."""
    try:
        _read_header(path)  # accepts image headers only
        return True
    except (_Unusable, OSError):
        in_root = path.resolve().parent == root.resolve()
        return in_root and IMAGE_NAME.fullmatch(path.name) is not None


def _canonical_state(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensor of every persistent state entry stored once, alias name -> stored name)."""
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    first_name: dict[int, str] = {}
    for name, value in model.state_dict(keep_vars=True).items():
        stored = first_name.setdefault(id(value), name)
        if stored == name:
            tensors[name] = value.detach().contiguous()
        else:
            aliases[name] = stored
    return tensors, aliases


def _read_header(path: Path) -> _Header:
    """Parse and check a safetensors header: sizes, dtypes, offsets and the file's length."""
    size = path.stat().st_size
    with open(path, "rb") as file:
        prefix = file.read(8)
        if len(prefix) < 8:
            raise _Unusable(f"it is {size} bytes long, too short for a header")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > min(MAX_HEADER_BYTES, size - 8):
            raise _Unusable(f"its header length {header_len} exceeds the file ({size} bytes)")
        raw = file.read(header_len)
    try:
        parsed = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise _Unusable(f"its header is not valid JSON: {err}") from None
    if not isinstance(parsed, dict):
        raise _Unusable("its header is not a JSON object")
    metadata = parsed.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or metadata.get("format") != IMAGE_FORMAT:
        raise _Unusable("its header does not mark it as a dgpp resident image")
    entries: dict[str, tuple[str, tuple[int, ...]]] = {}
    data_end = 0
    for name, entry in parsed.items():
        try:
            dtype, shape, (start, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            nbytes = ST_DTYPES[dtype].itemsize * math.prod(shape)
            valid = start >= 0 and min(shape, default=0) >= 0 and nbytes == end - start
        except (KeyError, TypeError, ValueError):
            valid = False
        if not valid:
            raise _Unusable(f"its header entry for {name!r} is malformed")
        entries[name] = (dtype, tuple(shape))
        data_end = max(data_end, end)
    if size != 8 + header_len + data_end:
        raise _Unusable(f"it is {size} bytes long, its header says {8 + header_len + data_end}")
    return _Header(entries, metadata)


def _checksum(tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """CRC-32 over each tensor's name, dtype, shape and bytes, in name order: 3.9 GiB/s here against
    1.7 for sha256 (docs/engine.md). It guards against corruption, not against tampering."""
    crc = 0
    for name, tensor in sorted(tensors, key=lambda item: item[0]):
        described = f"{name}\0{ST_NAMES[tensor.dtype]}\0{list(tensor.shape)}\0"
        crc = zlib.crc32(described.encode(), crc)
        crc = zlib.crc32(tensor.contiguous().reshape(-1).view(torch.uint8).numpy(), crc)
    return f"crc32:{crc:08x}"


def _remove_stale(image: Path, metadata: Mapping[str, str]) -> None:
    """Delete images that can never match again: older ones of the same checkpoint, rank, world,
    dtype and device (the checkpoint changed since), and those whose checkpoint directory is gone.
    Processes still mapping one keep valid pages (unlink, not truncate)."""
    same = ("checkpoint", "tp_rank", "tp_size", "dtype", "device_type")
    for info in list_images(image.parent):
        if info.path.name == image.name or info.problem is not None:
            continue
        superseded = all(info.metadata.get(field) == metadata[field] for field in same)
        if superseded or not Path(info.metadata.get("checkpoint", "")).is_dir():
            log.info("removing stale resident image %s", info.path)
            info.path.unlink(missing_ok=True)
