"""Agent sessions in the prefix cache (`dgpp.engine.cache.sessions`), no model: the order a
tier gives blocks up (anonymous LRU, then sessions least recently seen first, expired ones
before live ones), a released session's blocks going first, and a session's blocks moving from
the device to the host tier before any anonymous block leaves the host. The engine-level run:
tests/engine/test_sessions_engine.py."""

from __future__ import annotations

import logging

import pytest

from dgpp.engine.cache.block_manager import BlockManager
from dgpp.engine.cache.host_tier import HostTier
from dgpp.engine.cache.prefix_cache import HashPrefixCache
from dgpp.engine.cache.sessions import SessionLru, SessionTable
from dgpp.engine.execution.tier_setup import warn_short_host_tier
from dgpp.engine.sampling.sampling_params import SamplingParams
from dgpp.engine.scheduling.request import Request

BLOCK = 4


def test_anonymous_keys_go_first_then_the_least_recently_seen_session() -> None:
    table = SessionTable(ttl_s=60.0)
    table.seen("idle", now=0.0)  # expired by t = 100
    table.seen("busy", now=90.0)
    order: SessionLru[str] = SessionLru(table)
    order.add("busy-1", "busy")
    order.add("anon-1")
    order.add("idle-1", "idle")
    order.add("anon-2")
    order.add("busy-2", "busy")
    order.add("idle-2", "idle")
    order.touch("idle-1")  # used again: the newest of its session
    order.add("anon-1", None)  # re-added without a session: keeps being anonymous
    order.add("anon-2", "busy")  # a session's request reused it: the session's now
    assert table.expired("idle", now=100.0) and not table.expired("busy", now=100.0)
    popped = [order.pop() for _ in range(6)]
    assert popped == [
        ("anon-1", None),
        ("idle-2", "idle"),
        ("idle-1", "idle"),
        ("busy-1", "busy"),
        ("busy-2", "busy"),
        ("anon-2", "busy"),
    ]
    assert order.pop() is None and len(order) == 0


def test_a_released_session_goes_first_and_new_keys_of_it_are_anonymous() -> None:
    table = SessionTable()
    table.seen("agent")
    order: SessionLru[int] = SessionLru(table)
    order.add(1)
    order.add(2, "agent")
    order.add(3, "agent")
    assert order.counts() == {"agent": 2}
    table.release("agent")
    order.release("agent")
    order.add(4, "agent")  # a late request of the released session: anonymous
    assert [order.pop() for _ in range(4)] == [(2, None), (3, None), (1, None), (4, None)]


def _request(name: str, tokens: list[int], session: str | None) -> Request:
    return Request(name, tokens, SamplingParams(session=session), max_tokens=4)


def _serve(manager: BlockManager, request: Request) -> None:
    """Admit, compute every token, cache the full blocks, finish."""
    manager.arrive(request)
    manager.match_prefix(request)
    assert manager.allocate_slots(request, request.num_pending_tokens)
    request.num_computed_tokens = request.num_tokens
    manager.cache_computed_blocks(request)
    manager.free(request)


def test_a_session_keeps_its_blocks_against_anonymous_traffic_and_moves_down_to_host() -> None:
    """8 device blocks, a 4-slot host tier. An agent's 4 blocks, then 12 anonymous blocks:
    block LRU would have evicted the agent's first; here the anonymous ones go first, on the
    device and in the host tier, and the agent's next turn finds its whole prefix."""
    table = SessionTable()
    host = HostTier(4)
    manager = BlockManager(8, BLOCK, HashPrefixCache(sessions=table), 1, host=host, sessions=table)
    agent = list(range(1000, 1016))  # 4 blocks
    _serve(manager, _request("turn-1", agent, "agent"))
    assert manager.sessions.rows(BLOCK)[0]["tokens"] == {"device": 16, "host": 0}
    for index in range(3):  # 12 anonymous blocks through an 8-block pool
        _serve(
            manager, _request(f"batch-{index}", list(range(index * 100, index * 100 + 16)), None)
        )
    rows = manager.sessions.rows(BLOCK)
    assert rows[0]["id"] == "agent" and rows[0]["tokens"] == {"device": 16, "host": 0}
    turn = _request("turn-2", [*agent, 7, 8, 9], "agent")
    manager.arrive(turn)
    assert manager.match_prefix(turn) == 16  # every block still on the device
    manager.free(turn)
    # Now anonymous prompts of 6 blocks (24 tokens), more than the anonymous blocks on the
    # device: the agent's blocks move down to the host tier, whose anonymous slots go first
    # and where no anonymous block takes an agent's place; none is dropped.
    for index in range(3, 9):
        _serve(
            manager, _request(f"batch-{index}", list(range(index * 100, index * 100 + 24)), None)
        )
    rows = manager.sessions.rows(BLOCK)
    assert rows[0]["tokens"]["device"] + rows[0]["tokens"]["host"] == 16, rows[0]
    assert rows[0]["tokens"]["host"] > 0
    turn = _request("turn-3", [*agent, 7, 8, 9], "agent")
    manager.arrive(turn)
    assert manager.match_prefix(turn) == 16  # from the device and the host tier
    assert turn.num_host_tokens > 0
    assert table.snapshot()["agent"].hit_tokens == 32


def test_block_lru_without_sessions_loses_the_agent_prefix() -> None:
    """The same traffic with no session: the baseline the ordering is measured against."""
    manager = BlockManager(8, BLOCK, HashPrefixCache(), 1)
    agent = list(range(1000, 1016))
    _serve(manager, _request("turn-1", agent, None))
    for index in range(3):
        _serve(
            manager, _request(f"batch-{index}", list(range(index * 100, index * 100 + 16)), None)
        )
    turn = _request("turn-2", [*agent, 7, 8, 9], None)
    assert manager.match_prefix(turn) == 0


def test_a_host_tier_shorter_than_the_context_is_said_at_start(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="dgpp.engine.execution.tier_setup"):
        assert warn_short_host_tier(4096, 32768)
        assert not warn_short_host_tier(32768, 32768)
    assert "holds 4096 tokens, less than the context limit (32768)" in caplog.text
