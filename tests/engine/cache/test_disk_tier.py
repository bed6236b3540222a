"""The prefix cache's disk tier (`dgpp.engine.cache.disk_tier`, `disk_store`, `tier_file`,
`tier_layout`): every cached block is written to a file on every rank and kept across restarts;
after one, a conversation's next turn hits from disk with greedy outputs equal to a run without
any tier (paged KV and MLA latents, world 1 and world 2). A corrupt, truncated or missing file
is a miss, a full disk (a real tmpfs in a user namespace) keeps serving, another layout's files
are never read, and files are 0600 in a 0700 folder."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from dgpp.engine import LLM, SamplingParams
from dgpp.engine.cache.disk_store import DiskStore
from dgpp.engine.cache.disk_tier import FAILED, OK, PENDING, DiskTier
from dgpp.engine.cache.host_tier import DROP, FETCH, SAVE, HostTier
from dgpp.engine.cache.tier_file import (
    BlockFileError,
    file_name,
    read_header,
    read_payload,
    write_block,
)
from dgpp.engine.scheduling.request import Request
from dgpp.engine.server.metrics.prometheus import _tier_hits
from tests.conftest import build_tiny_checkpoint
from tests.engine.cache.test_host_tier import _run, _turns

BLOCK = (1, 2, 3, 4)
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _payload(values: list[float]) -> list[memoryview]:
    tensor = torch.tensor(values, dtype=torch.float32)
    return [memoryview(tensor.view(torch.uint8).numpy())]


def test_a_block_file_round_trips_and_refuses_damage(tmp_path: Path) -> None:
    path = tmp_path / file_name(-5)
    size = write_block(path, -5, 7, BLOCK, _payload([1.0, 2.0, 3.0]))
    assert path.stat().st_size == size and stat.S_IMODE(path.stat().st_mode) == 0o600
    header = read_header(path)
    assert (header.key, header.parent, header.tokens, header.payload_bytes) == (-5, 7, BLOCK, 12)
    assert bytes(read_payload(path, -5, 12)) == bytes(_payload([1.0, 2.0, 3.0])[0])
    with pytest.raises(BlockFileError, match="another block"):
        read_payload(path, -6, 12)
    with pytest.raises(BlockFileError, match="payload is 12 bytes"):
        read_payload(path, -5, 16)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x10  # one flipped bit in the payload
    path.write_bytes(bytes(data))
    with pytest.raises(BlockFileError, match="payload fails its checksum"):
        read_payload(path, -5, 12)
    path.write_bytes(bytes(data[:-3]))  # truncated
    with pytest.raises(BlockFileError, match="truncated"):
        read_header(path)
    data[9] ^= 0x01  # the key, in the header
    path.write_bytes(bytes(data))
    with pytest.raises(BlockFileError, match="header fails its checksum"):
        read_header(path)
    path.write_bytes(b"PK\x03\x04 not a block file at all, but long enough for a header")
    with pytest.raises(BlockFileError, match="not a dgpp block file"):
        read_header(path)


def _request(tokens: list[int], keys: list[int]) -> Request:
    request = Request("r", tokens, PARAMS, 4, None, seq_id=0)
    request.block_hashes = keys
    return request


def test_the_index_writes_evicts_fetches_and_settles_by_every_ranks_word() -> None:
    host = HostTier(num_slots=3)
    disk = DiskTier(host, num_blocks=2)
    disk.save(11, 0, BLOCK, block=5)
    disk.save(12, 11, BLOCK, block=6)
    disk.save(11, 0, BLOCK, block=7)  # has a file: only the newest now
    disk.save(13, 11, BLOCK, block=8)  # full: 12, the least recently used, is dropped
    assert host.take_copies() == ((SAVE, 5, 11), (SAVE, 6, 12), (DROP, 12, 0), (SAVE, 8, 13))
    assert disk.meta(11) == (0, BLOCK) and disk.meta(12) is None
    other = (5, 6, 7, 8)
    request = _request([0] * 13, [11, 13, 14])
    # 11 then 13 (whose parent is 11) are on disk; the chain stops at 14.
    assert disk.prefetch(request, [BLOCK, BLOCK, BLOCK], start=0) == 2
    assert host.take_copies() == ((FETCH, 11, 0), (FETCH, 13, 1))
    assert request.disk_pending == 2
    assert disk.prefetch(_request([0] * 5, [11]), [other], start=0) == 0  # other tokens: a miss
    disk.settle([PENDING, FAILED])  # 13 failed on some rank: a miss, and its files go
    assert request.disk_pending == 1 and host.take_copies() == ((DROP, 13, 0),)
    assert disk.meta(13) is None and not host.holds(13, BLOCK)
    disk.settle([OK])
    assert request.disk_pending == 0 and host.holds(11, BLOCK) and disk.fetching == []
    assert host.load(11, host.find(11, BLOCK), block=9)  # the first load says "from disk"
    assert disk.counters.fetched_blocks == 1 and disk.counters.failed_blocks == 1


def _store(root: Path, layout: str, budget: int = 1 << 20) -> tuple[DiskStore, torch.Tensor]:
    pool = torch.arange(24, dtype=torch.float32).view(4, 2, 3)  # 4 blocks of 24 bytes
    store = DiskStore(root, layout, [(pool, 0)], [torch.zeros(2, 2, 3)], budget)
    return store, pool


def test_a_store_writes_reads_and_reclaims_other_layouts_files_first(tmp_path: Path) -> None:
    old, pool = _store(tmp_path, "old")
    for key in (1, 2, 3):
        old.run(SAVE, key, key)  # block `key` under key `key`
    assert old.flush()
    old.close()
    file_size = (tmp_path / "old" / "rank0" / file_name(1)).stat().st_size
    # Room for four files: the new layout's writes reclaim the old one's, oldest first.
    new, pool = _store(tmp_path, "new", budget=4 * file_size)
    assert [h.key for h in new.headers()] == []
    for key in (1, 2, 3):
        new.run(SAVE, key, key)
    assert new.flush()
    assert sorted(p.name for p in (tmp_path / "old" / "rank0").iterdir()) == [file_name(3)]
    new.run(FETCH, 2, 1)  # key 2 into host slot 1
    new.run(FETCH, 9, 0)  # no such file
    assert new.states(2, wait_s=5.0) == [OK, FAILED]
    new.settle([OK, FAILED])
    assert new.fetches == [] and torch.equal(new.hosts[0][1], pool[2])
    new.run(DROP, 2, 0)
    assert new.flush() and not (tmp_path / "new" / "rank0" / file_name(2)).exists()
    new.close()


def _tiers(folder: Path) -> dict[str, object]:
    return {
        "prefix_cache_host_gib": 1e-4,
        "prefix_cache_disk_gib": 0.01,
        "prefix_cache_dir": str(folder),
    }


def _stop(llm: LLM) -> None:
    """The process's end, as far as the disk tier sees it: its queued writes finish."""
    runner = llm.engine.runner
    assert runner.disk is not None and runner.host is not None
    runner.disk.close()
    if runner.host.states is not None and runner.host.states.disk is not None:
        runner.host.states.disk.close()


@pytest.mark.parametrize(
    "architecture", ["LlamaForCausalLM", "DeepseekV3ForCausalLM"], ids=["paged-kv", "mla-latents"]
)
def test_after_a_restart_the_next_turn_hits_from_disk(
    tmp_path: Path, tokenizer_dir: Path, architecture: str
) -> None:
    checkpoint = build_tiny_checkpoint(tmp_path, tokenizer_dir, architecture)
    expected, _ = _run(checkpoint, _turns())
    folder = tmp_path / "prefix"
    got, first = _run(checkpoint, _turns(), **_tiers(folder))
    assert got == expected
    written = first.engine.stats().counters.prefix_cache
    assert written.disk_saved_blocks == written.disk_blocks == 34 and written.disk_hit_tokens == 0
    _stop(first)
    files = sorted(folder.rglob("*.kv"))
    assert len(files) == 34 and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    assert stat.S_IMODE(files[0].parent.stat().st_mode) == 0o700
    # A new process: the third turn alone hits all its 12 usable blocks (of 12 full), from disk.
    got, second = _run(checkpoint, _turns()[2:], **_tiers(folder))
    assert got == expected[2:]
    cache = second.engine.stats().counters.prefix_cache
    assert cache.hit_tokens == cache.disk_hit_tokens == 48
    assert cache.disk_fetched_blocks == 12 and cache.disk_failed_blocks == 0
    assert cache.disk_read_bytes > 0 and second.engine.block_manager.num_used_blocks == 0
    family = _tier_hits("m", cache)  # Prometheus: dgpp:prefix_cache_tier_hits_total by tier
    assert {s.labels["tier"]: s.value for s in family.samples} == {
        "device": 0,
        "host": 0,
        "disk": 48,
    }


def test_a_hybrid_models_turn_after_a_restart_hits_from_disk(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    """Qwen3-Next: the attention layers' blocks and the recurrent-state snapshot at the hit's
    depth both come back from disk (the snapshots in their own files, beside the blocks')."""
    checkpoint = build_tiny_checkpoint(
        tmp_path, tokenizer_dir, "Qwen3NextForCausalLM", mlp_only_layers=[1]
    )
    expected, _ = _run(checkpoint, _turns(), prefix_cache_gib=2e-5)
    folder = tmp_path / "prefix"
    knobs = {**_tiers(folder), "prefix_cache_host_gib": 1e-3, "prefix_cache_gib": 2e-5}
    got, first = _run(checkpoint, _turns(), **knobs)
    assert got == expected
    _stop(first)
    assert len(list(folder.rglob("rank0-states/*.kv"))) == 3  # one snapshot per prompt
    got, second = _run(checkpoint, _turns()[2:], **knobs)
    assert got == expected[2:]
    cache = second.engine.stats().counters.prefix_cache
    assert cache.hit_tokens == cache.disk_hit_tokens == 48 and cache.disk_failed_blocks == 0
    assert cache.disk_fetched_blocks == 12 + 1  # the blocks, and the snapshot at their end


def test_a_corrupt_or_truncated_block_file_is_a_miss(
    tmp_path: Path, tokenizer_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    checkpoint = build_tiny_checkpoint(tmp_path, tokenizer_dir, "LlamaForCausalLM")
    folder = tmp_path / "prefix"
    turn = list(range(100, 140))
    expected, first = _run(checkpoint, [turn], **_tiers(folder))
    _stop(first)
    # The turn's blocks in order: damage the 4th's payload and cut the 7th short.
    files = {read_header(path).key: path for path in folder.rglob("*.kv")}
    from dgpp.engine.cache.prefix_cache import block_hashes, stable_salt

    salt = stable_salt(str(checkpoint.resolve()), "float32")
    chain = block_hashes(turn, 4, salt)
    assert set(chain) <= set(files)
    damaged = bytearray(files[chain[3]].read_bytes())
    damaged[-5] ^= 0xFF
    files[chain[3]].write_bytes(bytes(damaged))
    with open(files[chain[6]], "r+b") as file:
        file.truncate(files[chain[6]].stat().st_size - 100)
    got, second = _run(checkpoint, [turn], **_tiers(folder))
    assert got == expected  # recomputed from the damaged block on, never read
    cache = second.engine.stats().counters.prefix_cache
    # Blocks 0-2 hit; the 4th failed its checksum. The truncated 7th is refused at start
    # (its size disagrees with its header) and removed, so it is never fetched.
    assert cache.disk_hit_tokens == cache.hit_tokens == 12 and cache.disk_failed_blocks >= 1
    assert "payload fails its checksum" in caplog.text and "truncated" in caplog.text
    _stop(second)  # recomputed, both are written whole again
    assert [read_header(files[chain[i]]).key for i in (3, 6)] == [chain[3], chain[6]]


def test_files_of_another_layout_are_never_read(tmp_path: Path, tokenizer_dir: Path) -> None:
    """A block size of 8 is another layout: its own folder, no hit from the files of 4."""
    checkpoint = build_tiny_checkpoint(tmp_path, tokenizer_dir, "LlamaForCausalLM")
    folder = tmp_path / "prefix"
    turn = list(range(100, 140))
    _, first = _run(checkpoint, [turn], **_tiers(folder))
    _stop(first)
    llm = LLM(
        str(checkpoint),
        kv_capacity=80,
        block_size=8,
        prefix_min_tokens=4,
        max_model_len=80,
        **_tiers(folder),
    )
    llm.generate([turn], PARAMS)
    assert llm.engine.stats().counters.prefix_cache.hit_tokens == 0
    assert len({path.parent.parent for path in folder.rglob("*.kv")}) == 2


_FULL_DISK = """
import json, sys
from dgpp.engine import LLM, SamplingParams
llm = LLM(sys.argv[1], kv_capacity=80, block_size=4, prefix_min_tokens=4, max_model_len=80,
          prefix_cache_host_gib=1e-4, prefix_cache_disk_gib=1.0, prefix_cache_dir=sys.argv[2])
params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
turns = json.loads(sys.argv[3])
out = [list(llm.generate([t], params)[0].outputs[0].token_ids) for t in turns]
llm.engine.runner.disk.flush()
cache = llm.engine.stats().counters.prefix_cache
print(json.dumps([out, cache.disk_unsaved_blocks, cache.disk_blocks]))
"""


def test_a_full_disk_keeps_serving(tmp_path: Path, tokenizer_dir: Path) -> None:
    """The cache directory is a real 64 KiB tmpfs (mounted in a user namespace): it fills after
    a few blocks, writes stop (said as unsaved blocks) and every answer stays right."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed")
    checkpoint = build_tiny_checkpoint(tmp_path, tokenizer_dir, "LlamaForCausalLM")
    expected, _ = _run(checkpoint, _turns())
    mount = tmp_path / "small"
    mount.mkdir()
    script = textwrap.dedent(_FULL_DISK)
    command = f'mount -t tmpfs -o size=64k none {mount} && exec {sys.executable} -c "$0" "$@"'
    probe = subprocess.run(["unshare", "-Urm", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"user namespaces are not allowed here: {probe.stderr.decode().strip()}")
    done = subprocess.run(
        ["unshare", "-Urm", "sh", "-c", command, script, str(checkpoint), str(mount / "pc")]
        + [json.dumps(_turns())],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got, unsaved, kept = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == expected
    assert unsaved > 0 and 0 < kept < 34  # some blocks fit, the rest were never written
    assert "is full; not writing blocks" in done.stderr


def test_world_of_two_equals_world_of_one_through_a_restart_from_disk(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    """Each rank writes and reads its own shard; rank 0 decides the hits with every rank's word
    on each read. A second world, started afresh, hits the first one's files; a third, whose
    rank 1 lost its files, reads rank 0's well but takes none of them (a miss on any rank is a
    miss for all: otherwise rank 1 would attend over a slot it never filled)."""
    from tests.engine.distributed import test_tensor_parallel as tp

    checkpoint = build_tiny_checkpoint(tmp_path, tokenizer_dir, "Qwen2ForCausalLM")
    prompts = [list(range(300, 340)), list(range(1000, 1040))]
    knobs = {**tp.KNOBS, "prefix_min_tokens": 4, **_tiers(tmp_path / "prefix")}
    assert tp._check_world_of_two(checkpoint, knobs, waves=(prompts,)) == 0
    assert len(list((tmp_path / "prefix").rglob("rank1/*.kv"))) >= 2 * 10
    assert tp._check_world_of_two(checkpoint, knobs, waves=(prompts,)) == 2 * 36
    for path in (tmp_path / "prefix").rglob("rank1/*.kv"):
        path.unlink()
    assert tp._check_world_of_two(checkpoint, knobs, waves=(prompts,)) == 0


def test_the_disk_tier_needs_the_host_tier() -> None:
    from dgpp.engine.configuration.engine_config import EngineConfig
    from dgpp.engine.errors import ConfigError

    with pytest.raises(ConfigError, match=r"prefix_cache_disk_gib .* needs prefix_cache_host_gib"):
        EngineConfig(model="m", prefix_cache_disk_gib=1.0)
    with pytest.raises(ConfigError, match="prefix_cache_dir"):
        EngineConfig(model="m", prefix_cache_dir="relative/path")


def test_a_request_reading_from_disk_waits_aside_while_others_step(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    """Its reads start when it arrives; the steps go on for the request already running (which
    gets a token every step) and it is admitted once every read is settled, then hits."""
    checkpoint = build_tiny_checkpoint(tmp_path, tokenizer_dir, "LlamaForCausalLM")
    folder = tmp_path / "prefix"
    turn, other = list(range(100, 140)), list(range(600, 610))
    expected, first = _run(checkpoint, [turn + [7, 8]], **_tiers(folder))
    _stop(first)
    _, llm = _run(checkpoint, [], **_tiers(folder))
    engine = llm.engine
    running = engine.add_request(other, SamplingParams(temperature=0.0, max_tokens=30))
    engine.step()
    reading = engine.add_request(turn + [7, 8], PARAMS)
    assert reading.disk_pending == 10  # the 10 usable blocks, every one on disk
    produced = len(running.output_token_ids)
    engine.step()
    assert reading not in engine.scheduler.running  # not admitted in the step of its arrival
    assert len(running.output_token_ids) == produced + 1
    outputs = {}
    while engine.has_unfinished():
        outputs |= {output.request_id: output for output in engine.step() if output.finished}
    assert list(outputs[reading.request_id].outputs[0].token_ids) == expected[0]
    assert engine.stats().counters.prefix_cache.disk_hit_tokens == 40
