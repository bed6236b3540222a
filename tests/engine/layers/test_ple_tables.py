"""Qwen4-Exp's PLE n-gram tables: the hashing is transformers' bit for bit (its constants for
the real config, every table row of random histories with end-of-sequence tokens inside), the
tables are read from the checkpoint's shards by row without entering the resident set (a
table of 128 MiB, measured in /proc/self/smaps), unless the knob reads them into RAM, and
the memory plan counts them as disk-backed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import transformers
from transformers.models.qwen4_exp import modeling_qwen4_exp as hf_qwen4

from dgpp.engine import LLM, SamplingParams
from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.layers.ngram_hash import NgramHashing
from dgpp.engine.layers.ngram_table import open_tables
from dgpp.engine.layers.ple import PerLayerEmbedding, ple_table_bytes
from tests.conftest import (
    TINY_COMMON,
    TINY_QWEN3_5,
    TINY_QWEN3_5_MOE,
    TINY_QWEN4_EXP,
    build_tiny_checkpoint,
)

ARCH = "Qwen4ExpForCausalLM"


def _text_config(**overrides: object) -> transformers.Qwen4ExpTextConfig:
    settings = {**TINY_COMMON, **TINY_QWEN3_5, **TINY_QWEN3_5_MOE, **TINY_QWEN4_EXP, **overrides}
    settings.pop("intermediate_size")
    return transformers.Qwen4ExpTextConfig(**settings)


def test_hashing_constants_are_transformers_for_the_release_sizes() -> None:
    """The released config's sizes (20M rows a head, 8 heads per order, several PLE layers):
    multipliers, primes and offsets as transformers derives them."""
    raw = {"vocab_size": 248320, "ngram_size": 3, "heads_per_ngram": 8, "eos_token_id": 2,
           "ngram_vocab_size_base": 20_000_000, "seed": 1234}  # fmt: skip
    config = _text_config(**{**raw, "ple_layer_ids": [1, 2], "hidden_size": 64})
    for index in (0, 1):
        ours = NgramHashing.of(raw, index)
        theirs = hf_qwen4.Qwen4ExpTextNGramEmbedding(config, 16, index, index)
        assert list(ours.multipliers) == theirs.layer_multipliers.tolist()
        assert list(ours.head_sizes) == theirs.head_vocab_sizes
        assert list(ours.head_offsets) == theirs.head_offsets


def test_table_rows_equal_transformers_for_random_histories() -> None:
    """transformers' embedding over a table whose row r holds r: its output is the rows it
    read; ours, over the same histories (end-of-sequence tokens in them), are the same."""
    config = _text_config()
    theirs = hf_qwen4.Qwen4ExpTextNGramEmbedding(config, 32, 0, 1)
    rows = theirs.ngram_embedding.weight.shape[0]
    with torch.no_grad():
        theirs.ngram_embedding.weight.copy_(torch.arange(rows).float().unsqueeze(1).expand(-1, 8))
    generator = torch.Generator().manual_seed(0)
    history = torch.randint(0, 49152, (3, 40), generator=generator)
    history[0, 7] = history[1, 0] = history[2, 38] = 2  # end-of-sequence inside
    with torch.no_grad():
        read = theirs(history, None)  # [B, L, heads * 8]
    expected = read.view(3, 40, -1, 8)[..., 0].long()
    ours = NgramHashing.of(config.to_dict(), 1)
    eos = torch.full((3, 2), 2)
    got = ours.ids(torch.cat((eos, history), dim=1))[:, 2:]
    assert torch.equal(got, expected)


def _mapped_rss(path: Path) -> int:
    """KiB of the mappings of `path` resident in this process (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            inside = line.endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


@pytest.fixture(scope="module")
def big_tables(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """One PLE layer whose table is 4 heads x ~1M rows x 8 floats: 128 MiB."""
    out = tmp_path_factory.mktemp("qwen4-tables")
    return build_tiny_checkpoint(
        out, tokenizer_dir, ARCH, ple_layer_ids=[1], ngram_vocab_size_base=1_000_000
    )


def _rss(kind: str = "VmRSS") -> int:
    """This process's resident set (or its `RssFile` / `RssAnon` part), bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{kind}:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {kind}")


def test_tables_stay_on_disk(big_tables: Path) -> None:
    """Serving reads rows of the 128 MB table (hundreds a step): while a warmed engine serves
    new prompts its file-backed resident pages do not grow (a memory map of the table grew
    them by ~120 MiB for 200 rows: this kernel maps whole page-cache folios), its resident set
    grows by far less than the table, and no page of the file is mapped."""
    llm = LLM(str(big_tables), kv_capacity=512, block_size=4, prefill_chunk_tokens=16)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm.generate([list(range(100, 140))], params)  # warm: pools, kernels, allocator
    before, before_file = _rss(), _rss("RssFile")
    prompts = [list(range(start, start + 60)) for start in (3000, 9000, 20000, 41000)]
    llm.generate(prompts, params)  # 272 new tokens: ~1,000 distinct rows
    grown, grown_file = _rss() - before, _rss("RssFile") - before_file
    (layer,) = [m for m in llm.engine.runner.model.modules() if isinstance(m, PerLayerEmbedding)]
    assert layer.table is not None and layer.table.nbytes > 120 << 20
    print(f"table {layer.table.nbytes >> 20} MiB; serving grew the process {grown >> 10} KiB")
    assert grown_file < 1 << 20  # file pages: what a mapped table would have grown (~120 MiB)
    assert grown < layer.table.nbytes // 4  # whatever serving allocates, never the table
    assert _mapped_rss(big_tables / "model.safetensors") == 0
    model = ModelConfig.from_checkpoint(big_tables)
    assert ple_table_bytes(model, 4) == layer.table.nbytes


def test_the_knob_reads_tables_into_ram(big_tables: Path) -> None:
    """`ngram_tables_in_memory`: every shard read into RAM (no file left open), the same rows.
    (The process's resident set is no measure here: a read may reuse freed heap pages.)"""
    (table,) = open_tables(big_tables, in_memory=True).values()
    assert all(part.data is not None and part.fd < 0 for part in table.parts)
    assert sum(part.data.numel() * part.data.element_size() for part in table.parts) == table.nbytes
    (mapped,) = open_tables(big_tables).values()
    assert all(part.data is None and part.fd >= 0 for part in mapped.parts)
    ids = torch.tensor([[0, 5, 1_000_003, 3_900_000]])
    assert torch.equal(table.rows(ids), mapped.rows(ids))


def test_the_memory_plan_counts_tables_in_ram_only(big_tables: Path) -> None:
    """On disk the plan names the tables and leaves them out of the total; with the knob they
    are in it."""
    from dgpp.engine.configuration.engine_config import EngineConfig
    from dgpp.engine.planning.device_memory import DeviceMemory
    from dgpp.engine.planning.memory_plan import plan_memory

    model = ModelConfig.from_checkpoint(big_tables)
    memory = DeviceMemory(64 << 30, 64 << 30, "test", is_accelerator=False)
    plans = [
        plan_memory(
            EngineConfig(model=str(big_tables), kv_capacity=256, ngram_tables_in_memory=held),
            model,
            1,
            memory,
        )
        for held in (False, True)
    ]
    on_disk, in_ram = plans
    assert on_disk.table_bytes == in_ram.table_bytes == ple_table_bytes(model, 4) > 120 << 20
    assert in_ram.total_bytes - on_disk.total_bytes == on_disk.table_bytes
    assert "n-gram tables 122.1 MiB read from disk by row" in on_disk.describe()
    assert "n-gram tables 122.1 MiB in RAM" in in_ram.describe()
