"""A GGUF file seen as a checkpoint directory: config.json, the tokenizer and its chat template,
and generation_config.json, all derived from the file's header, beside a link to the file.

Every other part of dgpp reads checkpoints as directories (config, tokenizer, chat template,
resident-image keys); a view lets a GGUF file be served as it is, its weights read from the file
itself (`loader.load_weights`). A view is written once, atomically, into a directory named
after the file and its identity (size, mtime), and reused after.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from dgpp.engine.errors import ModelLoadError
from dgpp.engine.quant.gguf_bert import bert_tokenizer, write_bert_pooling
from dgpp.engine.quant.gguf_file import GgufFile
from dgpp.kernels.cache_dir import dgpp_cache_dir

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

WEIGHTS_NAME = "model.gguf"
VIEW_MARKER = ".dgpp-gguf-view"
VIEW_FORMAT = 1  # bump when what a view holds changes: older views are rebuilt


def default_views_dir() -> Path:
    return dgpp_cache_dir() / "gguf"


def gguf_in(directory: Path) -> Path | None:
    """The one GGUF file of a directory without config.json (a downloaded GGUF repo), if any."""
    if (directory / "config.json").is_file():
        return None
    found = sorted(directory.glob("*.gguf"))
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise ModelLoadError(
            f"{directory} holds several GGUF files ({names}); name one", param="model"
        )
    return found[0] if found else None


def view_for(path: Path) -> Path | None:
    """The view of `path` when it is a GGUF file or a directory holding one (and no config.json);
    None when it is neither."""
    if path.is_file():
        return ensure_view(path) if path.suffix == ".gguf" else None
    if path.is_dir():
        found = gguf_in(path)
        return ensure_view(found) if found is not None else None
    return None


def ensure_view(gguf: Path, views_dir: Path | None = None) -> Path:
    """The view directory of `gguf`, written first when it is missing or stale."""
    gguf = gguf.resolve()
    if not gguf.is_file():
        raise ModelLoadError(f"{gguf} is not a file", param="model")
    stat = gguf.stat()
    identity = f"{VIEW_FORMAT}:{gguf}:{stat.st_size}:{stat.st_mtime_ns}"
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    root = views_dir or default_views_dir()
    target = root / f"{gguf.stem}-{digest}"
    if (target / VIEW_MARKER).is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{gguf.stem}.tmp-", dir=root))
    try:
        write_view(gguf, staging, tokenizer_cache=root / ".tokenizers")
        (staging / VIEW_MARKER).write_text(identity + "\n")
        staging.chmod(0o755)
        try:
            os.replace(staging, target)
        except OSError:
            if not (target / VIEW_MARKER).is_file():  # not a concurrent writer that won
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def write_view(
    gguf: Path, out_dir: Path, link: bool = True, tokenizer_cache: Path | None = None
) -> None:
    """Write config.json, tokenizer files and generation_config.json for `gguf` into `out_dir`,
    and `model.gguf` (a symbolic link to it, or a copy when not `link`). Converted tokenizers
    are kept in `tokenizer_cache` when given."""
    write_header_files(GgufFile(gguf), out_dir, tokenizer_cache)
    weights = out_dir / WEIGHTS_NAME
    if link:
        weights.symlink_to(gguf)
    else:
        shutil.copyfile(gguf, weights)


def write_header_files(
    source: GgufFile, out_dir: Path, tokenizer_cache: Path | None = None
) -> dict[str, object]:
    """config.json, the tokenizer with its chat template and generation_config.json of
    `source`, from its header, written into `out_dir`; returns the config written."""
    config = source.hf_config()
    template = source.field("tokenizer.chat_template")
    _write_tokenizer(source, out_dir, tokenizer_cache)
    if source.arch == "bert":
        write_bert_pooling(source, out_dir)
    eos = [config["eos_token_id"]] if "eos_token_id" in config else []
    eot = source.field("tokenizer.ggml.eot_token_id")
    if eot is not None and int(eot) not in eos:
        eos.append(int(eot))
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if template:
        tokenizer_config_path = out_dir / "tokenizer_config.json"
        tokenizer_config = json.loads(tokenizer_config_path.read_text())
        tokenizer_config["chat_template"] = str(template)
        tokenizer_config_path.write_text(json.dumps(tokenizer_config, indent=2) + "\n")
        (out_dir / "chat_template.jinja").write_text(str(template))
    generation = {"bos_token_id": config.get("bos_token_id"), "eos_token_id": eos}
    pad = source.field("tokenizer.ggml.padding_token_id")
    if pad is not None:
        generation["pad_token_id"] = int(pad)
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return config


def _write_tokenizer(source: GgufFile, out_dir: Path, cache_dir: Path | None) -> None:
    """The tokenizer files transformers builds from the file's vocabulary (seconds for a large
    one), kept per vocabulary in `cache_dir`: quantizations of one model share it."""
    if source.arch == "bert":  # WordPiece, rebuilt here (transformers converts no BERT GGUF)
        bert_tokenizer(source).save_pretrained(str(out_dir))
        return
    if cache_dir is None:
        _tokenizer(source.path).save_pretrained(str(out_dir))
        return
    digest = hashlib.sha256()
    for key in sorted(k for k in source.reader.fields if k.startswith("tokenizer.ggml.")):
        digest.update(key.encode())
        digest.update(source.reader.field_bytes(key))
    cached = cache_dir / digest.hexdigest()[:16]
    if not cached.is_dir():
        cache_dir.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".tokenizer.tmp-", dir=cache_dir))
        try:
            _tokenizer(source.path).save_pretrained(str(staging))
            try:
                os.replace(staging, cached)
            except OSError:
                if not cached.is_dir():
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    for item in cached.iterdir():
        shutil.copyfile(item, out_dir / item.name)


def _tokenizer(gguf: Path) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except Exception as err:  # transformers' GGUF tokenizer conversion raises many kinds
        raise ModelLoadError(f"cannot build the tokenizer of {gguf.name}: {err}") from None
