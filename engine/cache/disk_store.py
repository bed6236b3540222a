"""The prefix cache's disk tier on one rank: block files under the node's cache directory,
written and read by background threads so a step never waits on the disk.

Files live in `<root>/<layout>/rank<r>/`, where `layout` is a digest of everything that makes a
block's bytes valid (`dgpp.engine.planning.tier_layout`): another model, dtype, cache layout or
world writes elsewhere and never reads these. Files of other layouts are kept for a switch back and
reclaimed, oldest first, when this layout's need room; this rank's files stay within `budget`
bytes in all. A write that cannot be made (the backlog is full, the disk is) is skipped and
said (`unsaved`), and a full disk pauses writing for a while; a read that fails is a miss.
"""

from __future__ import annotations

import atexit
import errno
import logging
import os
import queue
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from pathlib import Path

import torch

from dgpp.engine.cache.disk_tier import FAILED, OK, PENDING
from dgpp.engine.cache.host_tier import DROP, FETCH, SAVE
from dgpp.engine.cache.tier_file import (
    SUFFIX,
    BlockFileError,
    BlockHeader,
    file_bytes,
    file_name,
    read_header,
    read_payload,
    write_block,
)
from dgpp.engine.configuration.parallel import ParallelContext

log = logging.getLogger(__name__)

_FLUSH = -1  # a writer job: say when every job before it is done

MAX_BACKLOG_BYTES = 256 << 20  # block copies waiting to be written, at most
FULL_PAUSE_S = 30.0  # after the disk filled up, no write is tried for this long
CLOSE_TIMEOUT_S = 10.0  # at exit, the writes queued get this long to finish
IDLE_WAIT_S = 0.05  # a step of fetches alone waits this long for them (then rank 0 looks again)
_OPEN: weakref.WeakSet[DiskStore] = weakref.WeakSet()


@atexit.register
def flush_open_stores(timeout_s: float = CLOSE_TIMEOUT_S) -> None:
    """Let every open store's queued writes reach the disk (up to `timeout_s` in all): at a
    normal exit, and before a server process leaves with `os._exit`."""
    deadline = time.monotonic() + timeout_s
    for store in list(_OPEN):
        store.flush(max(deadline - time.monotonic(), 0.0))


class DiskStore:
    def __init__(
        self,
        root: Path,
        layout: str,
        pools: Sequence[tuple[torch.Tensor, int]],
        hosts: Sequence[torch.Tensor],
        budget: int,
        rank: int = 0,
        kind: str = "blocks",
        fetches: list[Future] | None = None,
    ) -> None:
        """`pools`: this rank's cache tensors with their block axis; `hosts`: the host tier's
        copies of them, which fetches fill. `kind`: "blocks", or "states" for a hybrid model's
        snapshots (their own folder, `fetches` shared with the blocks' store: rank 0 settles
        them in one order)."""
        self.folder = root / layout / (f"rank{rank}" if kind == "blocks" else f"rank{rank}-{kind}")
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        for folder in (root, root / layout):  # mkdir's mode stops at existing parents
            if folder.stat().st_uid == os.getuid():
                folder.chmod(0o700)
        self.pools, self.hosts, self.budget = list(pools), list(hosts), budget
        self.payload_bytes = sum(
            pool.select(axis, 0).numel() * pool.element_size() for pool, axis in self.pools
        )
        # What a file's header says besides the key: rank 0 writes the block's parent and tokens
        # (its index hands them over; None for a block it forgot meanwhile: not written).
        self.meta: Callable[[int], tuple[int, tuple[int, ...]] | None] = lambda key: (0, ())
        self.unsaved: Callable[[int], None] = lambda key: None  # rank 0: its index forgets it
        self._own: OrderedDict[int, int] = OrderedDict()  # key -> file bytes, oldest first
        self._foreign: deque[tuple[Path, int]] = deque()  # other layouts' files, oldest first
        self._used = 0  # bytes of both
        self._lock = threading.Lock()
        self._scan(root)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._backlog = 0
        self._full_until = 0.0
        self._writer = threading.Thread(target=self._write_loop, name="dgpp-disk-tier", daemon=True)
        self._writer.start()
        self._readers = ThreadPoolExecutor(2, thread_name_prefix="dgpp-disk-read")
        # In the order rank 0 told every rank (a list shared by both stores of a hybrid model).
        self.fetches: list[Future] = fetches if fetches is not None else []
        self.read_bytes = 0
        self.read_seconds = 0.0
        _OPEN.add(self)

    def headers(self) -> list[BlockHeader]:
        """Rank 0: the headers of this layout's files, oldest first (for its index); a file
        that is not sound is logged and removed."""
        found = []
        with self._lock:
            keys = list(self._own)
        for key in keys:
            path = self.folder / file_name(key)
            try:
                header = read_header(path)
                if header.key != key:
                    raise BlockFileError("its name and header disagree")
            except (OSError, BlockFileError) as problem:
                log.warning("prefix cache: ignoring block file %s: %s", path, problem)
                self._delete_own(key)
                continue
            found.append(header)
        return found

    def run(self, op: int, a: int, b: int) -> None:
        """One of the disk tier's ops, in message order (the host tier's own copies run
        beside them)."""
        if op == SAVE:
            self._save(a, b)
        elif op == FETCH:
            self.fetches.append(self._readers.submit(self._fetch, a, b))
        elif op == DROP:
            self._jobs.put((DROP, a, None))
        else:
            raise ValueError(f"not a disk-tier op: {op}")

    def states(self, count: int, wait_s: float) -> list[int]:
        """This rank's state of its `count` oldest fetches, after waiting up to `wait_s` for
        them to finish."""
        futures = self.fetches[:count]
        if wait_s > 0 and futures:
            wait_futures(futures, timeout=wait_s)
        return [
            (OK if f.exception() is None and f.result() else FAILED) if f.done() else PENDING
            for f in futures
        ]

    def settle(self, states: Sequence[int]) -> None:
        """Every rank agreed on `states` of the oldest fetches: forget those settled."""
        head = self.fetches[: len(states)]
        kept = [f for f, state in zip(head, states, strict=True) if state == PENDING]
        self.fetches[: len(states)] = kept

    def drain(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Forget every fetch in flight (a new world starts with none), once the reads are
        done: none may land in a host slot after the slot has a new owner."""
        wait_futures(self.fetches, timeout=timeout_s)
        self.fetches.clear()

    def flush(self, timeout_s: float = CLOSE_TIMEOUT_S) -> bool:
        """Wait (up to `timeout_s`) for the writes queued so far; False if they did not end."""
        done = threading.Event()
        self._jobs.put((_FLUSH, 0, done))
        return done.wait(timeout_s)

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Finish the writes queued (for up to `timeout_s`) and stop the threads."""
        self._jobs.put(None)
        self._writer.join(timeout_s)
        self._readers.shutdown(wait=False, cancel_futures=True)
        _OPEN.discard(self)

    def _save(self, block: int, key: int) -> None:
        meta = self.meta(key)
        if meta is None:
            return
        size = self.payload_bytes
        with self._lock:
            skip = self._backlog + size > MAX_BACKLOG_BYTES or time.monotonic() < self._full_until
            if not skip:
                self._backlog += size
        if skip:
            self.unsaved(key)
            return
        parts = []
        for pool, axis in self.pools:  # the block's bytes now: the step after may reuse it
            part = pool.select(axis, block)
            parts.append(torch.empty(part.shape, dtype=part.dtype).copy_(part))
        self._jobs.put((SAVE, key, (meta, parts)))

    def _write_loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            op, key, data = job
            if op == _FLUSH:
                data.set()
                continue
            if op == DROP:
                self._delete_own(key)
                continue
            meta, parts = data
            try:
                self._write(key, meta, parts)
            except Exception as problem:  # never the thread's end: the next block may fit
                self.unsaved(key)
                if isinstance(problem, OSError) and problem.errno in (errno.ENOSPC, errno.EDQUOT):
                    log.warning(
                        "prefix cache: %s is full; not writing blocks for %.0f s",
                        self.folder,
                        FULL_PAUSE_S,
                    )
                    self._full_until = time.monotonic() + FULL_PAUSE_S
                else:
                    log.warning("prefix cache: cannot write in %s: %s", self.folder, problem)
            finally:
                with self._lock:
                    self._backlog -= self.payload_bytes

    def _write(self, key: int, meta: tuple[int, tuple[int, ...]], parts: list) -> None:
        parent, tokens = meta
        views = [memoryview(part.view(-1).view(torch.uint8).numpy()) for part in parts]
        self._make_room(file_bytes(self.payload_bytes, len(tokens)))
        written = write_block(self.folder / file_name(key), key, parent, tokens, views)
        with self._lock:
            self._used += written - self._own.pop(key, 0)
            self._own[key] = written

    def _make_room(self, size: int) -> None:
        """Delete files, other layouts' oldest first, until `size` more bytes fit the budget
        (this rank's own oldest go only when its index and rank 0's disagree: rank 0 drops)."""
        while self._used + size > self.budget and (self._foreign or self._own):
            if self._foreign:
                path, freed = self._foreign.popleft()
                path.unlink(missing_ok=True)
                with self._lock:
                    self._used -= freed
            else:
                with self._lock:
                    key = next(iter(self._own))
                self._delete_own(key)

    def _delete_own(self, key: int) -> None:
        with self._lock:
            self._used -= self._own.pop(key, 0)
        (self.folder / file_name(key)).unlink(missing_ok=True)

    def _fetch(self, key: int, slot: int) -> bool:
        """Read block `key` into host `slot` of every pool; False (logged) when its file is
        missing, truncated, corrupt or another block's."""
        path = self.folder / file_name(key)
        started = time.perf_counter()
        try:
            payload = read_payload(path, key, self.payload_bytes)
            data = torch.frombuffer(payload, dtype=torch.uint8)
            at = 0
            for host, (_, axis) in zip(self.hosts, self.pools, strict=True):
                target = host.select(axis, slot)
                size = target.numel() * target.element_size()
                target.copy_(data[at : at + size].view(target.dtype).view(target.shape))
                at += size
        except FileNotFoundError:
            return False
        except Exception as problem:  # a miss, whatever went wrong: never the step's end
            log.warning("prefix cache: block file %s is unusable (a miss): %s", path, problem)
            return False
        with self._lock:
            self.read_bytes += len(payload)
            self.read_seconds += time.perf_counter() - started
        return True

    def _scan(self, root: Path) -> None:
        """This rank's files of this layout (oldest first) and every other layout's under
        `root` (the sibling ranks' of this layout are theirs, not foreign); a temporary file a
        write of this rank's left is removed."""
        own, foreign = [], []
        for entry in os.scandir(self.folder):
            if entry.name.startswith("."):
                Path(entry.path).unlink(missing_ok=True)  # a write cut short
            elif entry.name.endswith(SUFFIX) and entry.is_file():
                try:
                    key = int(entry.name[: -len(SUFFIX)], 16)
                except ValueError:
                    continue
                stat = entry.stat()
                own.append((stat.st_mtime, key if key < 1 << 63 else key - (1 << 64), stat.st_size))
        for layout in os.scandir(root):
            if layout.is_dir() and layout.path != str(self.folder.parent):
                for folder, _, names in os.walk(layout.path):
                    for name in names:
                        if name.endswith(SUFFIX):
                            try:
                                stat = os.stat(os.path.join(folder, name))
                            except FileNotFoundError:  # its own rank removed it meanwhile
                                continue
                            foreign.append((stat.st_mtime, Path(folder, name), stat.st_size))
        for _, key, size in sorted(own, key=lambda item: item[0]):
            self._own[key] = size
        self._foreign = deque((path, size) for _, path, size in sorted(foreign, key=lambda f: f[0]))
        self._used = sum(self._own.values()) + sum(size for _, size in self._foreign)
        self._make_room(0)


def agreed_states(
    disk: DiskStore, count: int, wait_s: float, parallel: ParallelContext, device: torch.device
) -> list[int]:
    """The state every rank agrees on for the `count` oldest fetches (after waiting up to
    `wait_s` for this rank's): FAILED where any rank failed, else PENDING where any is still
    reading, else OK. Every rank of the world calls it at the same point of the same step."""
    states = disk.states(count, wait_s)
    if parallel.tp_size > 1:
        flags = [[state == FAILED for state in states], [state == PENDING for state in states]]
        summed = torch.tensor(flags, dtype=torch.int32, device=device)
        parallel.all_reduce(summed)
        failed, pending = summed.tolist()
        agreed = zip(failed, pending, strict=True)
        states = [FAILED if gone else PENDING if busy else OK for gone, busy in agreed]
    disk.settle(states)
    return states
