"""Finding, fetching and listing checkpoints for `dgpp model list|pull|install-default`.

A model reference is `default` (the built-in model's GGUF, see `models.default`; `default:float32`
its float32 expansion), a local checkpoint directory or GGUF file, or a Hugging Face repo id that
`pull` has put in the hub cache (`repo:TAG` for one GGUF file of a GGUF repo, named by its
quantization, as llama.cpp's `-hf`). Serving never touches the network: `resolve_model` only
looks on disk. Every failure is a `ModelLoadError` whose message says what to run next.
"""

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import huggingface_hub
from huggingface_hub.errors import (
    CacheNotFound,
    GatedRepoError,
    HFValidationError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from tqdm import tqdm

from dgpp.appliance.common.paths import expanded, hf_hub_cache_dir, models_dir
from dgpp.appliance.models.default import (
    DEFAULT_FORM,
    DEFAULT_MODEL_NAME,
    INSTALL_FORMS,
    default_model_path,
    install_default,
    installed_default,
)
from dgpp.engine.errors import ModelLoadError
from dgpp.engine.quant.gguf_view import view_for
from dgpp.engine.quant.quant_schemes import describe_quantization

__all__ = [
    "DEFAULT_MODEL_NAME",
    "ModelEntry",
    "default_model_path",
    "install_default",
    "list_models",
    "pull",
    "resolve_model",
]

DEFAULT_REFERENCE = "default"
# What a transformers checkpoint needs: config, weights, tokenizer and chat template. Files in
# subfolders (original/, onnx/, ...) and Mistral's duplicate consolidated weights are skipped.
CHECKPOINT_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]
SKIPPED_PATTERNS = ["*/*", "consolidated*.safetensors"]
_PATH_PREFIXES = ("/", "./", "../", "~", ".\\", "..\\")


@dataclass(frozen=True)
class ModelEntry:
    """One checkpoint on this machine, as `dgpp model list` shows it."""

    name: str
    path: Path
    architecture: str | None
    size_bytes: int
    source: Literal["dgpp", "hf-cache"]
    quantization: str = "none"  # `describe_quantization`: GGUF Q4_1, GPTQ int4 g128, ...


def _hub_offline() -> bool:
    """HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE as set now (huggingface_hub reads them at import)."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}:
            return True
    return False


def split_quant_tag(reference: str) -> tuple[str, str | None]:
    """`org/repo:Q4_K_M` -> (`org/repo`, `Q4_K_M`): one GGUF file of a GGUF repo, named by its
    quantization as llama.cpp's `-hf` does; (reference, None) without a tag."""
    repo, colon, tag = reference.rpartition(":")
    if colon and repo.count("/") == 1 and tag and "/" not in tag:
        return repo, tag
    return reference, None


def _gguf_patterns(tag: str) -> list[str]:
    return sorted({f"*{tag}*.gguf", f"*{tag.upper()}*.gguf", f"*{tag.lower()}*.gguf"})


def tagged_gguf(snapshot: Path, tag: str, repo_id: str) -> Path:
    """The one GGUF file of `snapshot` whose name carries `tag`."""
    found = sorted(path for path in snapshot.rglob("*.gguf") if tag.lower() in path.name.lower())
    if not found:
        raise ModelLoadError(f"{repo_id} has no GGUF file named like {tag!r}", param="model")
    if any("-of-0" in path.name for path in found):
        raise ModelLoadError(
            f"{repo_id}:{tag} is split into several GGUF files, which dgpp does not read yet",
            param="model",
        )
    if len(found) > 1:
        names = ", ".join(path.name for path in found)
        raise ModelLoadError(
            f"{repo_id}:{tag} matches several GGUF files ({names}); name one exactly",
            param="model",
        )
    return found[0]


def _hub_endpoint() -> str | None:
    """HF_ENDPOINT as set now (a mirror; None: huggingface_hub's own default)."""
    return os.environ.get("HF_ENDPOINT", "").strip().rstrip("/") or None


def pull(
    repo_id: str,
    revision: str | None = None,
    local_dir: Path | None = None,
    tqdm_class: type[tqdm] | None = None,
) -> Path:
    """Download a checkpoint from the Hugging Face hub into its cache, or into `local_dir` (a
    weights directory such as the NFS share, `paths.models_dir`); return its snapshot dir (for
    `repo:TAG`, the one GGUF file of the repo named like TAG, e.g. Q4_K_M).

    Files already there are not fetched again. huggingface_hub draws its own progress bars unless
    `tqdm_class` replaces them (it sees the byte counts; an exception it raises stops the pull).
    """
    offline = _hub_offline()
    repo_id, tag = split_quant_tag(repo_id)
    where = f"{repo_id}@{revision}" if revision else repo_id
    try:
        snapshot = huggingface_hub.snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=hf_hub_cache_dir(),
            local_dir=local_dir,
            local_files_only=offline,
            allow_patterns=CHECKPOINT_PATTERNS if tag is None else _gguf_patterns(tag),
            ignore_patterns=SKIPPED_PATTERNS,
            tqdm_class=tqdm_class,
            endpoint=_hub_endpoint(),
        )
    except GatedRepoError as error:
        raise ModelLoadError(
            f"{repo_id} is gated: accept its terms on huggingface.co, then run `hf auth login`",
            param="model",
        ) from error
    except RepositoryNotFoundError as error:
        raise ModelLoadError(
            f"{repo_id} was not found on the Hugging Face hub (if it is private, log in with "
            "`hf auth login`)",
            param="model",
        ) from error
    except RevisionNotFoundError as error:
        raise ModelLoadError(f"{repo_id} has no revision {revision!r}", param="model") from error
    except LocalEntryNotFoundError as error:
        if offline:
            message = f"cannot download {where}: HF_HUB_OFFLINE is set and it is not in the cache"
        else:
            message = f"cannot download {where}: the hub could not be reached ({error})"
        raise ModelLoadError(message, param="model") from error
    except HFValidationError as error:
        raise ModelLoadError(
            f"{repo_id!r} is not a valid repo id ({error})", param="model"
        ) from error
    except OSError as error:  # other hub HTTP errors, network and disk failures
        raise ModelLoadError(f"downloading {where} failed: {error}", param="model") from error
    path = Path(snapshot)
    if tag is not None:
        return tagged_gguf(path, tag, repo_id)
    if not (path / "config.json").is_file():
        raise ModelLoadError(
            f"{repo_id} has no config.json, so it is not a transformers checkpoint (a GGUF repo? "
            f"name one of its files by quantization: `dgpp model pull {repo_id}:Q4_K_M`)",
            param="model",
        )
    return path


def _resolve_cached_gguf(repo_id: str, tag: str) -> Path:
    """The view of the cached GGUF file `repo_id:tag`, without any network access."""
    try:
        snapshot = huggingface_hub.snapshot_download(
            repo_id,
            cache_dir=hf_hub_cache_dir(),
            local_files_only=True,
            allow_patterns=_gguf_patterns(tag),
        )
    except (LocalEntryNotFoundError, HFValidationError) as error:
        raise ModelLoadError(
            f"model {repo_id}:{tag} is not downloaded; run `dgpp model pull {repo_id}:{tag}`",
            param="model",
        ) from error
    view = view_for(tagged_gguf(Path(snapshot), tag, repo_id))
    assert view is not None
    return view


def _resolve_cached(repo_id: str) -> Path:
    """The cached snapshot of `repo_id` (its `main` ref), without any network access."""
    try:
        snapshot = huggingface_hub.snapshot_download(
            repo_id,
            cache_dir=hf_hub_cache_dir(),
            local_files_only=True,
            allow_patterns=CHECKPOINT_PATTERNS,
            ignore_patterns=SKIPPED_PATTERNS,
        )
    except HFValidationError as error:
        raise ModelLoadError(
            f"model {repo_id!r} is not {DEFAULT_REFERENCE!r}, a local directory or a Hugging Face "
            "repo id",
            param="model",
        ) from error
    except LocalEntryNotFoundError as error:
        raise ModelLoadError(
            f"model {repo_id} is not downloaded (or only partly); run `dgpp model pull {repo_id}`",
            param="model",
        ) from error
    path = Path(snapshot)
    if not (path / "config.json").is_file():
        raise ModelLoadError(
            f"cached {repo_id} has no config.json; run `dgpp model pull {repo_id}`", param="model"
        )
    return path


def _resolve_default(tag: str) -> Path:
    """`default` (the GGUF) or `default:FORM`: the default model's install in that form."""
    forms = {form.lower(): form for form in INSTALL_FORMS}
    form = forms.get(tag.lower())
    if form is None:
        names = ", ".join(f"default:{name}" for name in INSTALL_FORMS)
        raise ModelLoadError(f"the default model comes as {names}, not {tag!r}", param="model")
    path = installed_default(form)
    if path is None:
        flag = "" if form == DEFAULT_FORM else f" --dtype {form}"
        raise ModelLoadError(
            f"the default model ({DEFAULT_MODEL_NAME}, {form}) is not installed; run "
            f"`dgpp model install-default{flag}`",
            param="model",
        )
    return path


def resolve_model(reference: str) -> Path:
    """The checkpoint directory that `reference` names, looking only on this machine."""
    if reference == DEFAULT_REFERENCE or reference.startswith(f"{DEFAULT_REFERENCE}:"):
        return _resolve_default(reference.partition(":")[2] or DEFAULT_FORM)
    local = expanded(reference)
    view = view_for(local)  # a GGUF file, or a directory holding one: served through a view
    if view is not None:
        return view
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise ModelLoadError(
                f"{local} has no config.json, so it is not a checkpoint directory", param="model"
            )
        return local
    if local.exists():
        raise ModelLoadError(
            f"{local} is a file but not a GGUF file; give a checkpoint directory or a .gguf file",
            param="model",
        )
    if reference.startswith(_PATH_PREFIXES):
        raise ModelLoadError(f"no such checkpoint directory: {local}", param="model")
    repo_id, tag = split_quant_tag(reference)
    if tag is not None:
        return _resolve_cached_gguf(repo_id, tag)
    return _resolve_cached(reference)


def _config(checkpoint_dir: Path) -> dict[str, Any]:
    """config.json, or {} when it cannot be read."""
    try:
        config = json.loads((checkpoint_dir / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _architecture(checkpoint_dir: Path) -> str | None:
    """config.json's first architecture, or None if it names none or cannot be read."""
    architectures = _config(checkpoint_dir).get("architectures")
    if isinstance(architectures, list) and architectures and isinstance(architectures[0], str):
        return architectures[0]
    return None


def quantization(checkpoint_dir: Path) -> str:
    """How the checkpoint's weights are stored (`none` for a dense one)."""
    try:
        return describe_quantization(_config(checkpoint_dir), checkpoint_dir)
    except ModelLoadError:
        return "unreadable hf_quant_config.json"


def _entry(
    name: str, path: Path, size_bytes: int, source: Literal["dgpp", "hf-cache"]
) -> ModelEntry:
    return ModelEntry(name, path, _architecture(path), size_bytes, source, quantization(path))


def _tree_size(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())


def _dgpp_models() -> list[ModelEntry]:
    root = models_dir()
    if not root.is_dir():
        return []
    return [
        _entry(child.name, child, _tree_size(child), "dgpp")
        for child in sorted(root.iterdir())
        if child.is_dir() and not child.name.startswith(".") and (child / "config.json").is_file()
    ]


def _hf_cache_models() -> list[ModelEntry]:
    try:
        cache = huggingface_hub.scan_cache_dir(hf_hub_cache_dir())
    except CacheNotFound:
        return []
    entries = []
    for repo in sorted(cache.repos, key=lambda repo: repo.repo_id):
        if repo.repo_type != "model" or not repo.revisions:
            continue
        # The revision `main` points at, else the newest one.
        revision = max(repo.revisions, key=lambda rev: ("main" in rev.refs, rev.last_modified))
        snapshot = revision.snapshot_path
        if (snapshot / "config.json").is_file():
            entries.append(_entry(repo.repo_id, snapshot, revision.size_on_disk, "hf-cache"))
    return entries


def list_models() -> list[ModelEntry]:
    """Checkpoints installed by dgpp, then those in the Hugging Face hub cache."""
    return _dgpp_models() + _hf_cache_models()
