"""The root cause of a failed rank 0, read from log tails as rank 0 writes them: a
configuration it cannot run (exit code 3), a command line refused before logging starts, a
Python traceback, the journal's prefix; and no cause at all, where the switch keeps its words."""

from __future__ import annotations

from dgpp.webui.switch.root_cause import MAX_CHARS, root_cause
from dgpp.webui.switch.switcher import _failure, _Outcome

MEMORY_PLAN = (
    "ConfigError: this rank's memory plan does not fit: weights 92.1 MiB + KV pool 4291534.42 GiB "
    "(100000000000 tokens) + buffers 4.0 MiB + workspace 438.6 MiB = 4291534.95 GiB of a 21.00 "
    "GiB budget (21.00 GiB free) on cpu (host RAM); at most about 477113 KV tokens would fit. "
    "Lower kv_capacity (--kv-capacity), max_concurrency (--max-concurrency) or "
    "prefill_chunk_tokens (--prefill-chunk-tokens), raise memory_fraction (--memory-fraction), "
    "or use more ranks (tensor parallelism) to shard the model"
)
# `dgpp serve --model default --kv-capacity 100000000000`, as it printed it (exit code 3).
CONFIG_EXIT = f"""\
2026-12-02T04:30:48.474+00:00 rank0 INFO uvicorn.error: Started server process [12642]
2026-12-02T04:30:48.480+00:00 rank0 INFO uvicorn.error: Waiting for application startup.
2026-12-02T04:30:48.482+00:00 rank0 INFO uvicorn.error: Application startup complete.
2026-12-02T04:30:48.483+00:00 rank0 INFO uvicorn.error: Uvicorn running on http://127.0.0.1:18080
2026-12-02T04:30:53.037+00:00 rank0 ERROR dgpp.head: cannot serve: {MEMORY_PLAN}
2026-12-02T04:30:53.057+00:00 rank0 INFO uvicorn.error: Shutting down
2026-12-02T04:30:53.160+00:00 rank0 INFO uvicorn.error: Waiting for application shutdown.
2026-12-02T04:30:53.161+00:00 rank0 INFO uvicorn.error: Application shutdown complete.
2026-12-02T04:30:53.161+00:00 rank0 INFO uvicorn.error: Finished server process [12642]"""
# The same from an older rank 0 (logging's default time, uvicorn's own format).
OLDER_CONFIG_EXIT = f"""\
INFO:     Uvicorn running on http://127.0.0.1:18080 (Press CTRL+C to quit)
2026-12-02 04:18:34,387 rank0 ERROR dgpp.head: cannot serve: {MEMORY_PLAN}
INFO:     Shutting down
INFO:     Finished server process [6202]"""

TRACEBACK = """\
2026-12-02T05:01:10.001+00:00 rank0 INFO dgpp.head: loading /models/qwen3-0.6b
2026-12-02T05:01:12.554+00:00 rank0 ERROR dgpp.rank: rank 0 failed
Traceback (most recent call last):
  File "/opt/dgpp/appliance/rank_cli.py", line 166, in _run
    runtime.run()
  File "/opt/dgpp/engine/model_runner.py", line 88, in load
    raise RuntimeError("CUDA error: out of memory")
RuntimeError: CUDA error: out of memory
2026-12-02T05:01:12.601+00:00 rank0 INFO dgpp.head: stopped"""


def test_a_configuration_exit_names_the_configuration_error() -> None:
    assert root_cause(CONFIG_EXIT) == MEMORY_PLAN
    assert root_cause(OLDER_CONFIG_EXIT) == MEMORY_PLAN


def test_an_error_of_the_http_server_is_a_cause() -> None:
    tail = (
        "2026-12-02T04:30:48.474+00:00 rank0 ERROR uvicorn.error: [Errno 98] error while "
        "attempting to bind on address ('0.0.0.0', 8000): address already in use\n"
        "2026-12-02T04:30:48.480+00:00 rank0 INFO uvicorn.error: Waiting for application shutdown."
    )
    assert root_cause(tail) == (
        "[Errno 98] error while attempting to bind on address ('0.0.0.0', 8000): "
        "address already in use"
    )


def test_the_journal_prefix_is_dropped() -> None:
    journal = "\n".join(
        f"2026-12-02T04:18:34+0000 spark-1 dgpp-rank0[4242]: {line}"
        for line in CONFIG_EXIT.splitlines()
    )
    assert root_cause(journal) == MEMORY_PLAN


def test_a_traceback_names_its_exception_not_the_line_that_announced_it() -> None:
    assert root_cause(TRACEBACK) == "RuntimeError: CUDA error: out of memory"


def test_a_chained_traceback_names_the_last_exception() -> None:
    tail = """\
Traceback (most recent call last):
  File "a.py", line 1, in <module>
KeyError: 'hidden_size'

The above exception was the direct cause of the following exception:

Traceback (most recent call last):
  File "b.py", line 2, in <module>
dgpp.engine.errors.ModelLoadError: config.json has no hidden_size"""
    assert root_cause(tail) == "dgpp.engine.errors.ModelLoadError: config.json has no hidden_size"


def test_an_error_after_a_traceback_is_the_later_cause() -> None:
    tail = TRACEBACK + "\n2026-12-02 05:01:13,000 rank0 CRITICAL dgpp.head: the world broke"
    assert root_cause(tail) == "the world broke"


def test_a_command_line_refused_before_logging_starts() -> None:
    tail = "dgpp: error: the deployment: engine.kv_capacity: Input should be greater than 0"
    assert root_cause(tail) == "the deployment: engine.kv_capacity: Input should be greater than 0"
    usage = "usage: dgpp rank [-h] ...\ndgpp rank: error: argument --rank: invalid int value: 'x'"
    assert root_cause(usage) == "argument --rank: invalid int value: 'x'"


def test_warnings_and_info_are_no_cause() -> None:
    tail = """\
2026-12-02 05:01:10,001 rank0 INFO dgpp.head: loading /models/qwen3-0.6b
2026-12-02 05:01:11,002 rank0 WARNING dgpp.head: forming the world failed: rank 1 refused
INFO:     Shutting down"""
    assert root_cause(tail) is None
    assert root_cause("") is None


def test_a_cut_off_traceback_falls_back_to_the_error_before_it() -> None:
    cut = "\n".join(TRACEBACK.splitlines()[1:4])  # the error line, the header, one frame
    assert root_cause(cut) == "rank 0 failed"


def test_a_very_long_cause_is_shortened() -> None:
    cause = root_cause("rank0 ERROR dgpp.head: " + "x" * 5000)
    assert cause is not None and len(cause) == MAX_CHARS and cause.endswith("…")


def test_the_switch_reason_names_the_cause_and_keeps_the_detail_in_the_step() -> None:
    outcome = _failure("rank 0 failed", "exit code 3")
    reason, message = outcome.explained(CONFIG_EXIT)
    assert reason == f"rank 0 failed: {MEMORY_PLAN}"
    assert message == f"rank 0 failed (exit code 3): {MEMORY_PLAN}"


def test_without_a_cause_the_switch_keeps_its_own_words() -> None:
    outcome = _failure("rank 0 exited and is restarting", "activating/auto-restart")
    no_cause = "rank0 INFO dgpp.head: loading"
    expected = "rank 0 exited and is restarting (activating/auto-restart)"
    assert outcome.explained(no_cause) == (expected, expected)
    # A failure that is not rank 0's own (the supervisor refused the restart) never reads the
    # log: an error there may be the old process's.
    refused = _Outcome(False, "systemctl restart failed: access denied")
    assert refused.explained(CONFIG_EXIT)[0] == "systemctl restart failed: access denied"
