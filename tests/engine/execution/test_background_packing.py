"""Warm-start packing on its thread stops between layers when asked, and the interpreter asks at
exit: a short run that ends before packing does exits 0 after the layer in progress, instead of
tearing down native thread pools under a running kernel (which aborted `dgpp chat`, exit -6)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

from dgpp.engine.execution.background_packing import BackgroundPacking


class SlowLayer:
    """Stands in for a PackableLinear: packing takes `seconds`, and is recorded."""

    def __init__(self, seconds: float, packed: list[int], index: int) -> None:
        self.seconds, self.packed, self.index = seconds, packed, index

    def pack(self, packer: object, keep_dense: bool = True) -> None:
        assert keep_dense  # warm packing keeps the dense weight until the packed one is in
        time.sleep(self.seconds)
        self.packed.append(self.index)


def test_all_layers_are_packed_when_nobody_stops_it() -> None:
    packed: list[int] = []
    packing = BackgroundPacking([SlowLayer(0.01, packed, i) for i in range(5)], object())  # type: ignore[list-item]
    packing.join(10)
    assert packed == [0, 1, 2, 3, 4] and not packing.thread.is_alive()


def test_stop_ends_after_the_layer_in_progress() -> None:
    packed: list[int] = []
    packing = BackgroundPacking([SlowLayer(0.2, packed, i) for i in range(20)], object())  # type: ignore[list-item]
    time.sleep(0.3)
    started = time.monotonic()
    packing.stop()
    assert time.monotonic() - started < 1.0
    assert not packing.thread.is_alive() and 1 <= len(packed) < 20
    assert threading.current_thread() is threading.main_thread()


EXITS_EARLY = """
import logging, sys, time
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
sys.path.insert(0, {tests!r})
from test_background_packing import SlowLayer
from dgpp.engine.execution.background_packing import BackgroundPacking
packed = []
BackgroundPacking([SlowLayer(0.3, packed, i) for i in range(50)], object())
time.sleep(0.5)
print("exiting with", len(packed), "packed", flush=True)
"""


def test_the_interpreter_waits_for_the_layer_in_progress_at_exit() -> None:
    tests = str(Path(__file__).parent)
    result = subprocess.run(
        [sys.executable, "-c", EXITS_EARLY.format(tests=tests)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "exiting with" in result.stdout
    assert "packing stopped after" in result.stderr, result.stderr  # stopped, not killed
