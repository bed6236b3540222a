"""Resident weight images: written on a cold start, mapped on a warm one, rebuilt when stale or
damaged, never in the way of a load."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest
from safetensors import SafetensorError, safe_open

from dgpp.appliance.common.paths import resident_dir
from dgpp.appliance.offline import LLM as OfflineLLM
from dgpp.engine import LLM, SamplingParams
from dgpp.engine.checkpoint import loader
from dgpp.engine.planning import resident_cache
from tests.conftest import build_tiny_checkpoint

PROMPTS = [list(range(300, 330)), [5, 6, 7], list(range(1000, 1013))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
KNOBS = {"kv_capacity": 512, "block_size": 4}


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private XDG cache, so no test writes under the real home even through the default dir."""
    monkeypatch.delenv("DGPP_RESIDENT_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg"


@pytest.fixture
def checkpoint(tmp_path: Path, tokenizer_dir: Path) -> Path:
    return build_tiny_checkpoint(tmp_path / "tiny-qwen2", tokenizer_dir, "Qwen2ForCausalLM")


def _tokens(checkpoint: Path, cache: Path | None, **knobs: object) -> list[list[int]]:
    llm = LLM(
        str(checkpoint),
        resident_cache=cache is not None,
        resident_cache_dir=None if cache is None else str(cache),
        **KNOBS,
        **knobs,
    )
    return [list(out.outputs[0].token_ids) for out in llm.generate(PROMPTS, GREEDY)]


def _images(cache: Path) -> list[Path]:
    return sorted(cache.glob("*.safetensors"))


def _forbid_checkpoint_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the checkpoint was read on a warm start")

    monkeypatch.setattr(loader, "load_weights", refuse)
    monkeypatch.setattr(loader, "safe_open", refuse)


def test_cold_start_writes_an_image_and_warm_start_uses_it_without_the_checkpoint(
    checkpoint: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cache = tmp_path / "cache"
    uncached = _tokens(checkpoint, None)
    assert not (tmp_path / "xdg").exists()  # resident_cache=False writes nothing anywhere
    caplog.set_level(logging.INFO, logger="dgpp.engine.planning.resident_cache")
    cold = _tokens(checkpoint, cache)
    (image,) = _images(cache)
    assert image.name.startswith("tiny-qwen2-r0of1-float32-")
    assert "weights cold" in caplog.text and "written" in caplog.text
    caplog.clear()
    _forbid_checkpoint_reads(monkeypatch)
    warm = _tokens(checkpoint, cache)
    assert "weights warm" in caplog.text
    assert warm == cold == uncached
    assert _images(cache) == [image]
    assert not list(cache.glob(".*.tmp"))


def test_tied_embeddings_are_stored_once_and_tied_again(
    tmp_path: Path, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint = build_tiny_checkpoint(
        tmp_path / "tied", tokenizer_dir, "LlamaForCausalLM", tie_word_embeddings=True
    )
    cache = tmp_path / "cache"
    uncached = _tokens(checkpoint, None)
    assert _tokens(checkpoint, cache) == uncached
    (image,) = _images(cache)
    with safe_open(str(image), framework="pt") as handle:
        names = set(handle.keys())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert not any("rotary" in name for name in names)  # non-persistent tables are recomputed
    _forbid_checkpoint_reads(monkeypatch)
    llm = LLM(str(checkpoint), resident_cache_dir=str(cache), **KNOBS)
    model = llm.engine.runner.model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY)] == uncached


def _fake_checkpoint(folder: Path) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text('{"architectures": ["Qwen2ForCausalLM"]}')
    (folder / "model.safetensors").write_bytes(b"x" * 64)
    (folder / "tokenizer.json").write_text("{}")
    return folder


def test_every_key_component_changes_the_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    folder = _fake_checkpoint(tmp_path / "model")
    base = ("float32", "cpu", "Qwen2ForCausalLM")

    def key(rank: int = 0, world: int = 1, args: tuple[str, str, str] = base) -> str:
        return resident_cache.image_key(folder, rank, world, *args).digest

    shard = folder / "model.safetensors"
    first = key()
    assert key() == first  # stable
    (folder / "tokenizer.json").write_text('{"changed": true}')
    assert key() == first  # files outside the key do not matter
    digests = {first, key(rank=1, world=2), key(world=2), key(rank=1, world=4)}
    digests |= {key(args=("bfloat16", "cpu", base[2])), key(args=("float32", "cuda", base[2]))}
    digests.add(key(args=("float32", "cpu", "LlamaForCausalLM")))
    stat = shard.stat()
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    digests.add(key())
    shard.write_bytes(b"y" * 65)  # a new size under the same mtime
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    digests.add(key())
    config = folder / "config.json"
    config_stat = config.stat()
    config.write_text('{"architectures": ["Qwen3ForCausalLM"]}')
    os.utime(config, ns=(config_stat.st_atime_ns, config_stat.st_mtime_ns))
    assert config.stat().st_size == config_stat.st_size  # only the content differs
    digests.add(key())
    (folder / "model.safetensors.index.json").write_text("{}")
    digests.add(key())
    monkeypatch.setattr(resident_cache, "LOADER_FORMAT_VERSION", 2)
    digests.add(key())
    assert len(digests) == 12


def test_a_hub_snapshot_is_named_by_its_repo(tmp_path: Path) -> None:
    snapshots = tmp_path / "models--org--tiny" / "snapshots"
    snapshots.mkdir(parents=True)
    folder = _fake_checkpoint(snapshots / "0123abcd")
    key = resident_cache.image_key(folder, 1, 2, "bfloat16", "cuda", "Qwen2ForCausalLM")
    assert key.file_name == f"models--org--tiny-r1of2-bfloat16-{key.digest[:16]}.safetensors"


def test_a_changed_checkpoint_gets_a_new_image_that_replaces_the_old_one(
    checkpoint: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    _tokens(checkpoint, cache)
    (old,) = _images(cache)
    shard = checkpoint / "model.safetensors"
    stat = shard.stat()
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    _tokens(checkpoint, cache)
    (new,) = _images(cache)
    assert new != old


def test_images_of_deleted_checkpoints_are_removed_on_the_next_write(
    checkpoint: Path, tmp_path: Path, tokenizer_dir: Path
) -> None:
    cache = tmp_path / "cache"
    gone = build_tiny_checkpoint(tmp_path / "gone", tokenizer_dir, "Qwen2ForCausalLM")
    _tokens(gone, cache)
    (orphan,) = _images(cache)
    shutil.rmtree(gone)
    _tokens(checkpoint, cache)
    assert [image.name.split("-r0of1-")[0] for image in _images(cache)] == ["tiny-qwen2"]
    assert not orphan.exists()


def test_each_dtype_has_its_own_image(checkpoint: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    _tokens(checkpoint, cache)
    _tokens(checkpoint, cache, dtype="bfloat16")
    names = [image.name for image in _images(cache)]
    assert len(names) == 2 and any("-bfloat16-" in name for name in names)


@pytest.mark.parametrize(
    ("damage", "reason"),
    [("truncate", "bytes long, its header says"), ("header", "not valid JSON")],
)
def test_a_damaged_image_is_detected_and_rebuilt(
    checkpoint: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str, reason: str
) -> None:
    cache = tmp_path / "cache"
    expected = _tokens(checkpoint, cache)
    (image,) = _images(cache)
    size = image.stat().st_size
    if damage == "truncate":
        os.truncate(image, size - 100)
    else:
        with open(image, "r+b") as file:
            file.seek(8)
            file.write(b"XX")  # the header is no longer JSON
    caplog.set_level(logging.INFO, logger="dgpp.engine.planning.resident_cache")
    assert _tokens(checkpoint, cache) == expected
    assert "unusable" in caplog.text and reason in caplog.text and "weights cold" in caplog.text
    assert image.stat().st_size == size
    assert resident_cache.verify_image(image).is_ok


def test_verify_catches_a_bit_flip_in_the_data(checkpoint: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    _tokens(checkpoint, cache)
    (image,) = _images(cache)
    assert resident_cache.verify_image(image).is_ok
    with open(image, "r+b") as file:
        file.seek(-1000, os.SEEK_END)
        byte = file.read(1)
        file.seek(-1000, os.SEEK_END)
        file.write(bytes([byte[0] ^ 0x04]))
    check = resident_cache.verify_image(image)
    assert not check.is_ok and "checksum mismatch" in (check.problem or "")


def test_an_unwritable_cache_dir_does_not_fail_the_load(
    checkpoint: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")  # mkdir beneath a regular file fails, even for root
    expected = _tokens(checkpoint, None)
    assert _tokens(checkpoint, blocker / "cache") == expected
    assert "cannot write resident image" in caplog.text


def test_a_failed_write_leaves_no_partial_file(
    checkpoint: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch
) -> None:
    def disk_full(*args: object, **kwargs: object) -> None:
        raise SafetensorError("No space left on device")

    monkeypatch.setattr(resident_cache, "save_file", disk_full)
    cache = tmp_path / "cache"
    _tokens(checkpoint, cache)
    assert "No space left on device" in caplog.text
    assert list(cache.iterdir()) == []


def test_the_default_dir_follows_xdg_cache_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert resident_dir() == tmp_path / "xdg" / "dgpp" / "resident"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert resident_dir() == tmp_path / "home" / ".cache" / "dgpp" / "resident"
    monkeypatch.setenv("DGPP_RESIDENT_DIR", str(tmp_path / "explicit"))
    assert resident_dir() == tmp_path / "explicit"


def test_the_appliance_llm_keeps_images_in_the_default_dir_and_the_engine_alone_in_none(
    checkpoint: Path, private_cache: Path
) -> None:
    LLM(str(checkpoint), **KNOBS)  # the engine's own facade: no directory given, no image
    assert not private_cache.exists()
    OfflineLLM(str(checkpoint), **KNOBS)
    assert len(_images(private_cache / "dgpp" / "resident")) == 1


def test_a_warm_start_serves_at_once_and_packs_on_the_side(
    checkpoint: Path, tmp_path: Path
) -> None:
    """Warm weights are memory-mapped: the runner is ready before its linears are packed, serves
    on the dense weights meanwhile, and every layer ends up packed with the same tokens (the
    layer path's linears: the native decode step, off here, reads the mapped weights as they
    are and packs none, below)."""
    from dgpp.engine.execution.native_decode import covered_linears
    from dgpp.engine.layers.linear import PackableLinear
    from dgpp.kernels.linear import select_packer

    cache = tmp_path / "cache"
    cold = _tokens(checkpoint, cache)
    native = LLM(str(checkpoint), resident_cache_dir=str(cache), **KNOBS)
    if native.engine.runner.native is not None:
        covered = covered_linears(native.engine.runner.model)
        assert all(m.packed is None and m.weight is not None for m in covered)
        warm = [list(out.outputs[0].token_ids) for out in native.generate(PROMPTS, GREEDY)]
        assert warm == cold
    llm = LLM(str(checkpoint), resident_cache_dir=str(cache), native_decode=False, **KNOBS)
    runner = llm.engine.runner
    if select_packer(runner.device, runner.dtype) is None:
        pytest.skip("no packed kernel on this CPU")
    assert runner.packing is not None
    runner.packing.join(60)
    linears = [m for m in runner.model.modules() if isinstance(m, PackableLinear)]
    assert linears and all(m.packed is not None and m.weight is not None for m in linears)
    warm = [list(out.outputs[0].token_ids) for out in llm.generate(PROMPTS, GREEDY)]
    assert warm == cold
