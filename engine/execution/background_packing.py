"""Packing warm weights on a thread beside serving, stopped and joined before the interpreter
exits.

A warm start serves on the memory-mapped image at once and packs its linear layers on the side
(each layer switches to its packed form when done). A short run, `dgpp generate` or a `dgpp chat`
of one turn, can end before packing does; a daemon thread still inside a native kernel when the
interpreter tears down its thread pools aborted the process ("terminate called without an active
exception", exit -6). So packing stops between two layers when asked, and the interpreter asks,
and waits for it, at exit.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Sequence

from dgpp.engine.layers.embedding import ParallelLMHead
from dgpp.engine.layers.linear import PackableLinear
from dgpp.kernels.linear import LinearPacker

log = logging.getLogger(__name__)


class BackgroundPacking:
    """Packs `modules` with `packer` on a daemon thread, keeping their dense weights until each
    is packed; `stop()` (also run at interpreter exit) ends it after the layer in progress."""

    def __init__(
        self, modules: Sequence[PackableLinear | ParallelLMHead], packer: LinearPacker
    ) -> None:
        self._modules = list(modules)
        self._packer = packer
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="dgpp-pack", daemon=True)
        atexit.register(self.stop)
        self.thread.start()

    def _run(self) -> None:
        started = time.monotonic()
        for done, module in enumerate(self._modules):
            if self._stop.is_set():
                log.info("packing stopped after %d of %d layers", done, len(self._modules))
                return
            module.pack(self._packer, keep_dense=True)
        log.info(
            "packed %d linear layers in the background in %.2f s",
            len(self._modules),
            time.monotonic() - started,
        )
        atexit.unregister(self.stop)

    def join(self, timeout_s: float | None = None) -> None:
        self.thread.join(timeout_s)

    def stop(self, timeout_s: float = 120.0) -> None:
        """Stop after the layer being packed and wait for it (one layer: well under a second)."""
        self._stop.set()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(timeout_s)
