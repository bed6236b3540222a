"""A repo's folder in the Hugging Face cache as it was before a pull, so that a pull that fails or
is cancelled can take back what it added. huggingface_hub links each file into the snapshot as
it completes, so a partial snapshot already holds `config.json`, and `scan_cache_dir` (what
`dgpp model list` and the Models page read) would list it as installed.

After any failed pull: the snapshots it created are removed and the refs restored (`main` keeps
naming the revision it named). After a cancel also the partial blobs (`*.incomplete`), and the
whole folder when the pull created it. Completed blobs of an earlier revision are never touched."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub.file_download import repo_folder_name


@dataclass(frozen=True)
class CacheFolder:
    folder: Path  # <cache>/models--org--name
    existed: bool
    snapshots: frozenset[str]
    refs: dict[str, str]  # ref path under refs/ -> the commit it named

    @classmethod
    def before(cls, cache_dir: Path, repo_id: str) -> CacheFolder:
        folder = cache_dir / repo_folder_name(repo_id=repo_id, repo_type="model")
        snapshots = folder / "snapshots"
        names = frozenset(p.name for p in snapshots.iterdir()) if snapshots.is_dir() else ()
        refs_dir = folder / "refs"
        refs = {
            str(path.relative_to(refs_dir)): path.read_text()
            for path in (refs_dir.rglob("*") if refs_dir.is_dir() else ())
            if path.is_file()
        }
        return cls(folder, folder.exists(), frozenset(names), refs)

    def restore(self, cancelled: bool) -> None:
        """Take back what the pull added (see the module's docstring)."""
        if not self.folder.exists():
            return
        if cancelled and not self.existed:
            shutil.rmtree(self.folder, ignore_errors=True)
            lock = self.folder.parent / ".locks" / self.folder.name
            shutil.rmtree(lock, ignore_errors=True)
            return
        snapshots = self.folder / "snapshots"
        if snapshots.is_dir():
            for snapshot in snapshots.iterdir():
                if snapshot.name not in self.snapshots:
                    shutil.rmtree(snapshot, ignore_errors=True)
        refs_dir = self.folder / "refs"
        if refs_dir.is_dir():
            for path in refs_dir.rglob("*"):
                if path.is_file() and str(path.relative_to(refs_dir)) not in self.refs:
                    path.unlink(missing_ok=True)
        for name, commit in self.refs.items():
            (refs_dir / name).parent.mkdir(parents=True, exist_ok=True)
            (refs_dir / name).write_text(commit)
        if cancelled:
            for partial in (self.folder / "blobs").glob("*.incomplete"):
                partial.unlink(missing_ok=True)
