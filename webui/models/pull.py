"""Checkpoint downloads started from the console: `dgpp model pull` (`models.store.pull`,
huggingface_hub's `snapshot_download`) in a background thread, one job per repo at a time, with
its byte counts for the page's progress bar and a cancel that stops it.

Progress comes from huggingface_hub's own progress bars: the job hands it a tqdm class whose
bars count into the job instead of drawing. Cancelling makes the next count raise
`PullCancelledError` inside every download thread, which ends `snapshot_download`.

Where it lands: the weights directory the deployment names (`paths.models_dir`, e.g. the NFS
share every rank mounts), as `<models_dir>/<repo name>`, which is where a rank looks first;
else the Hugging Face cache, as `dgpp model pull`. No half-downloaded checkpoint is ever listed
as installed: into a weights directory the files go to a hidden `.<name>.partial` beside it,
renamed into place when complete; in the cache whatever the failed pull added to the repo's
folder (a snapshot, its refs) is taken away again, and after a cancel its partial files too.
After an error (not a cancel) the partial files stay, so pulling again resumes."""

from __future__ import annotations

import logging
import re
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tqdm import tqdm

from dgpp.engine.errors import DgppError, one_line
from dgpp.webui.models.pull_cleanup import CacheFolder

log = logging.getLogger(__name__)

Phase = Literal["downloading", "done", "failed", "cancelled"]
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


class PullCancelledError(Exception):
    """Raised inside huggingface_hub's download threads once the operator cancelled."""


class PullBusyError(Exception):
    """A pull of this repo is already running."""


class PullRefusedError(Exception):
    """A pull that cannot be started (a malformed repo id, a checkpoint already there)."""


def check_repo_id(repo_id: str) -> None:
    if not _REPO_ID.fullmatch(repo_id) or ".." in repo_id:
        raise PullRefusedError(
            f"{repo_id!r} is not a Hugging Face repo id (org/name); GGUF files (org/name:TAG) "
            "are pulled with `dgpp model pull` on the head"
        )


def listed_bytes(repo_id: str, local_dir: Path | None) -> int | None:
    """The bytes of what `pull` fetches of `repo_id`, from the listing huggingface_hub caches
    when a download starts (None before that, or with a huggingface_hub that keeps none)."""
    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    from dgpp.appliance.common.paths import hf_hub_cache_dir
    from dgpp.appliance.models.store import CHECKPOINT_PATTERNS, SKIPPED_PATTERNS

    listing = getattr(huggingface_hub, "get_cached_repo_tree", None)
    if listing is None:
        return None
    try:
        files = listing(repo_id, cache_dir=hf_hub_cache_dir(), local_dir=local_dir)
    except Exception:  # not listed yet
        return None
    sizes = {entry.path: entry.size for entry in files}
    names = filter_repo_objects(
        sizes, allow_patterns=CHECKPOINT_PATTERNS, ignore_patterns=SKIPPED_PATTERNS
    )
    return sum(sizes[name] for name in names)


def job_slug(repo_id: str) -> str:
    """`Qwen/Qwen3-8B` -> `Qwen--Qwen3-8B`: the job's element ids on the page."""
    return repo_id.replace("/", "--")


@dataclass
class PullJob:
    repo_id: str
    target: str  # where it lands, as the page shows it
    started_at: float = field(default_factory=time.time)
    phase: Phase = "downloading"
    message: str = ""  # the path when done, the error when failed
    finished_at: float | None = None
    _cancel: threading.Event = field(default_factory=threading.Event, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _byte_bars: list[tqdm] = field(default_factory=list, repr=False)
    _file_bars: list[tqdm] = field(default_factory=list, repr=False)  # files fetched, of all
    _listing: Callable[[], int | None] | None = field(default=None, repr=False)
    _listed: int | None = field(default=None, repr=False)  # bytes of the files to fetch

    @property
    def is_running(self) -> bool:
        return self.phase == "downloading"

    @property
    def is_cancelling(self) -> bool:
        return self._cancel.is_set() and self.is_running

    def bytes(self) -> tuple[int, int]:
        """(done, total) so far. huggingface_hub keeps two byte bars over the same files, one
        of bytes received and one of bytes written, whose total it may stretch: the written
        one (the smaller total) is the checkpoint's progress. Its total grows as each file
        starts; the listing of the repo's files, cached before the first one starts, gives the
        whole from the beginning."""
        with self._lock:
            bars = [(int(bar.n or 0), int(bar.total or 0)) for bar in self._byte_bars]
        sized = [bar for bar in bars if bar[1] > 0]
        if not sized:
            return 0, 0
        done, total = min(sized, key=lambda bar: bar[1])
        if self.phase == "done":
            return total, total  # files already there were never counted
        if self._listed is None and self._listing is not None:
            self._listed = self._listing()  # None until huggingface_hub has cached it
        total = max(total, self._listed or 0)
        return min(done, total), total

    def files(self) -> tuple[int, int]:
        """(fetched, total) files."""
        with self._lock:
            bars = [(int(bar.n or 0), int(bar.total or 0)) for bar in self._file_bars]
        return max(bars, key=lambda bar: bar[1], default=(0, 0))

    def as_json(self) -> dict[str, Any]:
        done, total = self.bytes()
        files_done, files_total = self.files()
        return {
            "repo_id": self.repo_id,
            "slug": job_slug(self.repo_id),
            "target": self.target,
            "phase": "cancelling" if self.is_cancelling else self.phase,
            "running": self.is_running,
            "message": self.message,
            "bytes_done": done,
            "bytes_total": total,
            "files_done": files_done,
            "files_total": files_total,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
        }

    def cancel(self) -> None:
        self._cancel.set()

    def progress_class(self) -> type[tqdm]:
        """A tqdm class whose bars count into this job and draw nothing."""
        job = self

        class JobProgress(tqdm):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                is_bytes = kwargs.get("unit") == "B"
                kwargs.pop("name", None)  # huggingface_hub's own bars take a name; tqdm does not
                super().__init__(*args, **{**kwargs, "disable": True})
                job._attach(self, is_bytes)

            def update(self, n: float | None = 1) -> bool | None:
                job._count(self, n or 0)
                return None

        return JobProgress

    def _attach(self, bar: tqdm, is_bytes: bool) -> None:
        with self._lock:
            (self._byte_bars if is_bytes else self._file_bars).append(bar)
        self._raise_if_cancelled()

    def _count(self, bar: tqdm, n: float) -> None:
        self._raise_if_cancelled()
        with self._lock:  # several download threads update one bar
            bar.n += n

    def _raise_if_cancelled(self) -> None:
        if self._cancel.is_set():
            raise PullCancelledError(f"the pull of {self.repo_id} was cancelled")

    def _finish(self, phase: Phase, message: str) -> None:
        self.phase, self.message, self.finished_at = phase, message, time.time()


class PullManager:
    """The console's pulls: the latest job of each repo, at most one running per repo."""

    def __init__(self, pull: Callable[..., Path] | None = None) -> None:
        self._pull = pull  # model_store.pull unless a test gives another
        self._lock = threading.Lock()
        self._jobs: dict[str, PullJob] = {}
        self._threads: list[threading.Thread] = []

    def jobs(self) -> list[PullJob]:
        with self._lock:
            return sorted(self._jobs.values(), key=lambda job: job.started_at, reverse=True)

    def job(self, repo_id: str) -> PullJob | None:
        with self._lock:
            return self._jobs.get(repo_id)

    def start(self, repo_id: str, weights_dir: Path | None) -> PullJob:
        """Start pulling `repo_id` into `weights_dir` (None: the Hugging Face cache)."""
        check_repo_id(repo_id)
        final = weights_dir / repo_id.split("/")[1] if weights_dir is not None else None
        if final is not None and final.exists():
            raise PullRefusedError(f"{final} already exists; remove it first to pull it again")
        with self._lock:
            running = self._jobs.get(repo_id)
            if running is not None and running.is_running:
                raise PullBusyError(f"{repo_id} is already being pulled")
            target = str(final) if final is not None else "the Hugging Face cache"
            job = self._jobs[repo_id] = PullJob(repo_id, target)
        staging = final.with_name(f".{final.name}.partial") if final is not None else None
        job._listing = lambda: listed_bytes(repo_id, staging)
        thread = threading.Thread(
            target=self._run, args=(job, final, staging), name=f"dgpp-pull-{repo_id}", daemon=True
        )
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()
        return job

    def cancel(self, repo_id: str) -> PullJob | None:
        """Ask the running pull of `repo_id` to stop; the job it was, or None."""
        job = self.job(repo_id)
        if job is None or not job.is_running:
            return None
        job.cancel()
        return job

    def close(self, timeout: float = 30.0) -> None:
        """Cancel every running pull (the console is stopping) and wait for each to clean up."""
        with self._lock:
            threads = list(self._threads)
            jobs = [job for job in self._jobs.values() if job.is_running]
        for job in jobs:
            job.cancel()
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _run(self, job: PullJob, final: Path | None, staging: Path | None) -> None:
        from dgpp.appliance.common.paths import hf_hub_cache_dir
        from dgpp.appliance.models import store as model_store

        pull = self._pull or model_store.pull
        cache = CacheFolder.before(hf_hub_cache_dir(), job.repo_id) if final is None else None
        try:
            path = pull(job.repo_id, local_dir=staging, tqdm_class=job.progress_class())
            if final is not None and staging is not None:
                staging.rename(final)  # one step: the checkpoint appears whole
                path = final
        except PullCancelledError:
            self._clean(cache, staging, cancelled=True)
            job._finish("cancelled", "cancelled; nothing of it is kept")
        except DgppError as err:
            self._clean(cache, staging, cancelled=False)
            job._finish("failed", err.message)
        except Exception as err:  # disk, permissions, the hub's own errors
            log.exception("pulling %s failed", job.repo_id)
            self._clean(cache, staging, cancelled=False)
            job._finish("failed", f"pulling {job.repo_id} failed: {one_line(err)}")
        else:
            job._finish("done", str(path))
        log.info("pull of %s: %s %s", job.repo_id, job.phase, job.message)

    @staticmethod
    def _clean(cache: CacheFolder | None, staging: Path | None, cancelled: bool) -> None:
        if cache is not None:
            cache.restore(cancelled)
        if staging is not None and cancelled:
            shutil.rmtree(staging, ignore_errors=True)
