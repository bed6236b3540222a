"""`dgpp cache list/verify/remove`, in-process through `cli.main(argv)`, on images a real cold
start wrote for a tiny random-weight checkpoint."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from dgpp.appliance import cli
from dgpp.appliance.offline import LLM
from tests.conftest import build_tiny_checkpoint

RunCli = Callable[..., tuple[int, str, str]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    folder = tmp_path_factory.mktemp("ckpt") / "tiny-llama"
    return build_tiny_checkpoint(folder, tokenizer_dir, "LlamaForCausalLM")


@pytest.fixture(autouse=True)
def xdg_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("DGPP_RESIDENT_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "dgpp" / "resident"


@pytest.fixture
def image(checkpoint: Path, xdg_cache: Path) -> Path:
    """The image a cold start writes into the default (XDG) cache directory."""
    LLM(str(checkpoint), kv_capacity=256, block_size=4)
    (found,) = xdg_cache.glob("*.safetensors")
    return found


@pytest.fixture
def run_cli(capsys: pytest.CaptureFixture[str]) -> RunCli:
    def run(*argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = cli.main(list(argv))
        out, err = capsys.readouterr()
        return code, out, err

    return run


def _flip_a_data_bit(path: Path) -> None:
    with open(path, "r+b") as file:
        file.seek(-64, os.SEEK_END)
        byte = file.read(1)[0]
        file.seek(-64, os.SEEK_END)
        file.write(bytes([byte ^ 0x01]))


def test_list_shows_each_image_with_its_model_rank_and_dtype(image: Path, run_cli: RunCli):
    code, out, _ = run_cli("cache", "list")
    assert code == 0
    (line,) = out.splitlines()
    path, model, rank, dtype, size, created = line.split("\t")
    assert (path, model, rank, dtype) == (str(image), "tiny-llama", "rank 0/1", "float32")
    assert size.endswith("MiB") and created.startswith("20")


def test_list_of_an_empty_dir(tmp_path: Path, run_cli: RunCli) -> None:
    code, out, _ = run_cli("cache", "--dir", str(tmp_path / "none"), "list")
    assert code == 0 and "no resident images" in out


def test_verify_passes_a_sound_image_and_names_a_corrupt_one(
    image: Path, xdg_cache: Path, run_cli: RunCli
) -> None:
    other = xdg_cache / image.name.replace("-r0of1-", "-r0of2-")
    other.write_bytes(image.read_bytes())
    assert run_cli("cache", "verify", "--all")[0] == 0
    _flip_a_data_bit(other)
    code, out, err = run_cli("cache", "--dir", str(xdg_cache), "verify", "--all")
    assert code == 1
    assert f"ok\t{image}" in out and f"CORRUPT\t{other}" in out
    assert str(other) in err and str(image) not in err
    code, out, err = run_cli("cache", "verify", str(other))
    assert code == 1 and "checksum mismatch" in out and str(other) in err


def test_verify_and_remove_need_all_or_paths(run_cli: RunCli, tmp_path: Path) -> None:
    for command in ("verify", "remove"):
        assert run_cli("cache", command)[0] == 2
        assert run_cli("cache", command, "--all", str(tmp_path))[0] == 2


def test_remove_a_path_then_all_with_leftover_temp_files(
    image: Path, xdg_cache: Path, run_cli: RunCli
) -> None:
    other = xdg_cache / image.name.replace("-r0of1-", "-r0of2-")
    other.write_bytes(image.read_bytes())
    leftover = xdg_cache / f".{image.name}.abc123.tmp"
    leftover.write_bytes(b"partial")
    code, out, _ = run_cli("cache", "remove", str(other))
    assert code == 0 and str(other) in out and not other.exists() and image.exists()
    code, out, _ = run_cli("cache", "remove", "--all")
    assert code == 0 and str(image) in out
    assert list(xdg_cache.iterdir()) == []


def test_remove_refuses_files_that_are_not_images(
    checkpoint: Path, image: Path, run_cli: RunCli
) -> None:
    shard = checkpoint / "model.safetensors"
    code, _, err = run_cli("cache", "remove", str(image), str(shard))
    assert code != 0 and str(shard) in err
    assert shard.exists() and image.exists()  # nothing is removed when any path is refused
    code, out, _ = run_cli("cache", "--dir", str(checkpoint), "remove", "--all")
    assert code == 0 and "no resident images" in out and shard.exists()
