"""Every rank's node readings reach rank 0: snapshots published into rank 0's store through a
fake store and an injected probe, a real TCP store, and a real `dgpp serve --world 2` whose
`GET /admin/nodes` lists both ranks. This machine has no NVIDIA GPU, so every GPU reading here is
"unavailable" with NVML's reason; the CPU readings are real."""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch.distributed as dist

from dgpp.appliance.runtime.node_probe import (
    DEFAULT_PUBLISH_S,
    CpuReading,
    NodeBoard,
    NodeProbe,
    NodePublisher,
    NvmlProbe,
    StoreLink,
    node_key,
    publish_interval_s,
    tcp_store_client,
)
from tests.appliance.world_harness import start, wait_healthy
from tests.conftest import build_tiny_checkpoint
from tests.engine.server.harness import free_port

CPU = CpuReading(4, 2400.0, 3000.0, "performance", (0.5, 0.25, 0.0), 12.5)


class FakeStore:
    """A dict with the store calls used; `down` makes every call fail like a lost connection."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.down = False

    def _reachable(self) -> None:
        if self.down:
            raise ConnectionError("rank 0 is away")

    def set(self, key: str, value: str) -> None:
        self._reachable()
        self.values[key] = value.encode()

    def check(self, keys: list[str]) -> bool:
        self._reachable()
        return all(key in self.values for key in keys)

    def get(self, key: str) -> bytes:
        self._reachable()
        return self.values[key]


def _no_nvml() -> Any:
    raise OSError("NVML Shared Library Not Found")


def _probe(rank: int) -> NodeProbe:
    return NodeProbe(rank, NvmlProbe(_no_nvml), lambda: CPU, hostname=f"node{rank}")


def test_the_publish_interval_comes_from_the_environment() -> None:
    assert publish_interval_s({}) == DEFAULT_PUBLISH_S
    assert publish_interval_s({"DGPP_NODE_PUBLISH_S": "0.5"}) == 0.5
    for bad in ("soon", "0", "-1"):
        assert publish_interval_s({"DGPP_NODE_PUBLISH_S": bad}) == DEFAULT_PUBLISH_S


def test_workers_publish_and_rank0_reads_every_rank() -> None:
    store = FakeStore()
    link = StoreLink(lambda: store)
    head = NodePublisher(_probe(0), link, 5.0)
    NodePublisher(_probe(1), link, 5.0).publish()
    board = NodeBoard(4, head, link)
    store.values[node_key(3)] = b"{not json"
    nodes = board.read()  # rank 0 has not published yet: it is probed on the spot
    assert [node["rank"] for node in nodes] == [0, 1, 2, 3]
    own, worker = nodes[0], nodes[1]
    assert own["hostname"] == "node0" and worker["hostname"] == "node1"
    assert worker["gpu"] == {
        "available": False,
        "reason": "unavailable: NVML Shared Library Not Found",
        "gpus": [],
    }
    assert worker["cpu"]["governor"] == "performance" and worker["cpu"]["load"] == [0.5, 0.25, 0]
    assert time.time() - worker["time"] < 5
    assert nodes[2] == {
        "rank": 2,
        "hostname": None,
        "time": None,
        "error": "no reading from this rank yet",
    }
    assert nodes[3]["error"] == "unreadable reading"
    head.publish()
    assert json.loads(store.values[node_key(0)])["hostname"] == "node0"
    assert board.read()[0] is head.latest


def test_a_world_of_one_reads_only_its_own_snapshot() -> None:
    board = NodeBoard(1, NodePublisher(_probe(0), None, 5.0), None)
    (own,) = board.read()
    assert own["rank"] == 0 and own["cpu"]["count"] == 4


def test_rank0_away_never_raises_and_the_link_reconnects() -> None:
    store, connects = FakeStore(), []

    def connect() -> FakeStore:
        connects.append(1)
        if store.down:
            raise ConnectionRefusedError("connection refused")
        return store

    link = StoreLink(connect)
    publisher = NodePublisher(_probe(1), link, 5.0)
    store.down = True
    assert publisher.publish()["rank"] == 1  # taken, kept, not delivered
    assert link.get(node_key(1)) is None and len(connects) == 2
    store.down = False
    publisher.publish()
    assert link.get(node_key(1)) is not None and len(connects) == 3
    store.down = True  # the connection breaks under a live link: dropped, and tried again later
    assert not link.set("k", "v")
    store.down = False
    assert link.set("k", "v") and len(connects) == 4


def test_the_publisher_thread_survives_a_failing_probe_and_stops_on_request() -> None:
    calls: list[int] = []

    def cpu() -> CpuReading:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("psutil broke")
        return CPU

    store = FakeStore()
    probe = NodeProbe(1, NvmlProbe(_no_nvml), cpu, hostname="node1")
    publisher = NodePublisher(probe, StoreLink(lambda: store), 0.01)
    stop = threading.Event()
    thread = publisher.start(stop)
    deadline = time.monotonic() + 10
    while node_key(1) not in store.values and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    thread.join(5)
    assert not thread.is_alive() and node_key(1) in store.values and len(calls) >= 2


def test_a_real_tcp_store_round_trip_and_an_absent_one() -> None:
    port = free_port()
    master = dist.TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5)
    )
    link = StoreLink(tcp_store_client("127.0.0.1", port, timeout_s=2.0))
    assert NodePublisher(_probe(1), link, 5.0).publish()
    assert json.loads(master.get(node_key(1)))["hostname"] == "node1"
    assert json.loads(link.get(node_key(1)) or b"{}")["rank"] == 1
    started = time.monotonic()
    absent = StoreLink(tcp_store_client("127.0.0.1", free_port(), timeout_s=2.0))
    assert not absent.set(node_key(1), "{}") and absent.get(node_key(1)) is None
    assert time.monotonic() - started < 5  # refused at once, not retried for the timeout


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("tiny-qwen3")
    return build_tiny_checkpoint(out, tokenizer_dir, "Qwen3ForCausalLM", num_key_value_heads=2)


def test_admin_nodes_lists_both_ranks_of_a_real_world(qwen3: Path, tmp_path: Path) -> None:
    port = free_port()
    args = ["serve", "--model", str(qwen3), "--world", "2", "--port", str(port)]
    args += ["--rendezvous-port", str(free_port()), "--served-model-name", "m"]
    args += ["--kv-capacity", "2048"]
    env = {"DGPP_CONSUMER_DEADLINE_S": "10", "DGPP_NODE_PUBLISH_S": "0.5"}
    process, url = start(args, tmp_path / "serve.log", env), f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process)
        deadline, nodes = time.monotonic() + 30, []
        while time.monotonic() < deadline:
            nodes = httpx.get(f"{url}/admin/nodes", timeout=10).json()["nodes"]
            if all(node["time"] is not None for node in nodes):
                break
            time.sleep(0.25)
        assert [node["rank"] for node in nodes] == [0, 1], nodes
        for node in nodes:
            assert node["hostname"] and 0 <= node["age_s"] < 10, node
            assert node["cpu"]["count"] >= 1 and len(node["cpu"]["load"]) == 3
            # No NVIDIA driver on this machine: unavailable, with the reason, not an error.
            gpu = node["gpu"]
            assert gpu["gpus"] if gpu["available"] else gpu["reason"].startswith("unavailable")
        # Snapshots keep coming: rank 1's is replaced within a few publish intervals.
        first = nodes[1]["time"]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if httpx.get(f"{url}/admin/nodes", timeout=10).json()["nodes"][1]["time"] != first:
                break
            time.sleep(0.25)
        else:
            raise AssertionError("rank 1 stopped publishing")
    finally:
        assert process.stop() == 0, process.text()[-3000:]
