"""What the Models page offers: every installed checkpoint (dgpp's own, the Hugging Face cache's,
and those in the deployment's weights directory) and every shipped template, each as the
deployment a switch to it would run, with what an operator weighs before switching — whether it
is the current one, on this machine, its size, quantization and world, whether it fits (the
memory plan, computed once and then kept, `plans.cache`), and the served names clients would have
to change to.

Everything here looks only at this machine; nothing is downloaded."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from dgpp.appliance.deployments.deployment import Deployment, checkpoint_of
from dgpp.appliance.deployments.diff import diff
from dgpp.engine.errors import ConfigError, DgppError
from dgpp.engine.planning.memory_plan import format_bytes
from dgpp.webui.deployments.edit import with_model, with_template
from dgpp.webui.deployments.store import resolve_raw, served_names
from dgpp.webui.models.pull import PullRefusedError, check_repo_id
from dgpp.webui.plans.cache import PlanCache
from dgpp.webui.plans.memory_preview import MemoryPreview


@dataclass(frozen=True)
class Installed:
    """A checkpoint directory on this machine."""

    name: str
    path: Path
    architecture: str | None
    size_bytes: int
    source: Literal["dgpp", "hf-cache", "weights dir"]
    quantization: str
    is_complete: bool = True  # False: a download that stopped partway (nothing to switch to)


@dataclass(frozen=True)
class Candidate:
    """One row of the page: a deployment a switch would run."""

    kind: Literal["checkpoint", "template"]
    name: str
    model: str  # the model reference the deployment names
    deployment: Deployment | None  # None: cannot be built (`problem` says why)
    problem: str
    is_current: bool
    is_downloaded: bool
    size_bytes: int | None  # on disk, when it is on this machine
    quantization: str  # as stored; "" for a template until its plan says
    served: tuple[str, ...]  # the names clients would use after the switch
    renames: str  # "" when clients keep their names; else what changes
    plan: MemoryPreview | None  # None: still being computed
    pull_repo: str | None = None  # the repo a Download button pulls (not downloaded templates)
    path: str = ""  # a checkpoint's directory
    architecture: str | None = None  # a checkpoint's, from its config.json
    source: str = ""  # a checkpoint's: dgpp, hf-cache or weights dir

    @property
    def key(self) -> str:
        """The row's id on the page and in `/api/models/fits`."""
        return f"{self.kind}:{self.name}"

    @property
    def slug(self) -> str:
        """`key` usable in element ids."""
        return "".join(c if c.isalnum() or c in "-_." else "-" for c in self.key)

    @property
    def size_text(self) -> str:
        """On disk when downloaded; else the weights rank 0 will hold, once planned."""
        if self.size_bytes is not None:
            return format_bytes(self.size_bytes)
        if self.plan is not None and self.plan.weights_bytes:
            return f"{format_bytes(self.plan.weights_bytes)} per rank"
        return "-"

    @property
    def quantization_text(self) -> str:
        """As stored; a template's from its plan (its checkpoint's facts), once planned."""
        if self.quantization:
            return self.quantization
        return self.plan.quantization if self.plan is not None and self.plan.quantization else "-"

    @property
    def world_size(self) -> int | None:
        return self.deployment.world_size if self.deployment is not None else None

    @property
    def fit_text(self) -> str:
        plan = self.plan
        if self.deployment is None:
            return self.problem
        if plan is None:
            return "checking…"
        if plan.verdict == "fits":
            return f"fits; up to {plan.largest_context:,} tokens per request"
        return "does not fit" if plan.verdict == "refused" else "unknown"

    @property
    def fits(self) -> str:
        """`checking`, `fits`, `refused` or `unknown` (the page's data-fits)."""
        if self.deployment is None:
            return "unknown"
        return "checking" if self.plan is None else self.plan.verdict

    def fit_json(self) -> dict[str, Any]:
        plan = self.plan
        return {
            "fits": self.fits,
            "text": self.fit_text,
            "summary": plan.summary() if plan is not None else "checking the memory plan",
            "size": self.size_text,
            "quantization": self.quantization_text,
            "largest_context": plan.largest_context if plan is not None else None,
            # rank 0 at each KV-cache dtype (`memory_preview.kv_dtype_table`); [] until planned
            "kv_dtype": plan.kv_dtype if plan is not None else None,
            "kv_dtypes": [row.to_json() for row in plan.kv_dtypes] if plan is not None else [],
        }


def _architecture(path: Path) -> str | None:
    try:
        names = json.loads((path / "config.json").read_text()).get("architectures")
    except (OSError, ValueError, AttributeError):
        return None
    return names[0] if isinstance(names, list) and names and isinstance(names[0], str) else None


def _tree_size(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())


def weights_dir_models(weights_dir: Path) -> list[Installed]:
    """The checkpoints in a weights directory (`paths.models_dir`), one folder each; hidden
    ones (a pull in progress, `.name.partial`) are not checkpoints yet."""
    from dgpp.appliance.models.store import quantization

    if not weights_dir.is_dir():
        return []
    return [
        Installed(
            child.name,
            child,
            _architecture(child),
            _tree_size(child),
            "weights dir",
            quantization(child),
        )
        for child in sorted(weights_dir.iterdir())
        if child.is_dir() and not child.name.startswith(".") and (child / "config.json").is_file()
    ]


def is_complete_snapshot(repo_id: str, snapshot: Path) -> bool:
    """Whether every file of a cached snapshot that `pull` fetches is there, by the listing
    huggingface_hub cached when it downloaded it (a snapshot without one counts as complete)."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    from dgpp.appliance.common.paths import hf_hub_cache_dir
    from dgpp.appliance.models.store import CHECKPOINT_PATTERNS, SKIPPED_PATTERNS

    try:
        huggingface_hub.snapshot_download(
            repo_id,
            revision=snapshot.name,  # the commit: no ref to follow, nothing fetched
            cache_dir=hf_hub_cache_dir(),
            local_files_only=True,
            allow_patterns=CHECKPOINT_PATTERNS,
            ignore_patterns=SKIPPED_PATTERNS,
        )
    except LocalEntryNotFoundError:  # IncompleteSnapshotError among them
        return False
    return True


def installed(current: Deployment | None) -> list[Installed]:
    """dgpp's checkpoints, the hub cache's (marked incomplete when a download stopped partway)
    and the current deployment's weights directory's."""
    from dgpp.appliance.models.store import list_models

    found = []
    for entry in list_models():
        complete = entry.source != "hf-cache" or is_complete_snapshot(entry.name, entry.path)
        found.append(
            Installed(
                entry.name,
                entry.path,
                entry.architecture,
                entry.size_bytes,
                entry.source,
                entry.quantization,
                complete,
            )
        )
    if current is not None and current.paths.models_dir is not None:
        found += weights_dir_models(Path(current.paths.models_dir).expanduser())
    return found


def renames(current: Deployment | None, served: tuple[str, ...]) -> str:
    """What a switch to a deployment serving `served` means for clients ("" when they keep
    their names): said once above the Models page's tables and in a switch's preview."""
    if current is None:
        return ""
    now = served_names(current)
    if set(now) == set(served):
        return ""
    return (
        f"clients now ask for {', '.join(now)}; after this switch the model answers to "
        f"{', '.join(served)}"
    )


def _real(path: Path) -> str:
    return os.path.realpath(path)


class Catalogue:
    """The page's rows for one request: the current deployment and this machine's checkpoints
    read once, each candidate compared against them."""

    def __init__(
        self,
        raw: dict[str, Any],
        current: Deployment | None,
        plans: PlanCache,
        schedule: Callable[[str], bool] = lambda key: False,
    ) -> None:
        self.raw = raw
        self.current = current
        self.plans = plans
        self.schedule = schedule  # which rows' unknown plans to compute in the background
        self.checkpoints = installed(current)
        self._sizes = {_real(entry.path): entry.size_bytes for entry in self.checkpoints}
        self._current_checkpoint = self._checkpoint(current) if current is not None else None

    @staticmethod
    def _checkpoint(deployment: Deployment) -> str | None:
        try:
            return _real(checkpoint_of(deployment))
        except DgppError:
            return None

    def _renames(self, served: tuple[str, ...]) -> str:
        return renames(self.current, served)

    def _candidate(
        self,
        kind: Literal["checkpoint", "template"],
        name: str,
        new_raw: dict[str, Any],
        entry: Installed | None = None,
    ) -> Candidate:
        try:
            deployment = resolve_raw(new_raw, f"the deployment with {name}")
        except ConfigError as err:
            return Candidate(
                kind=kind,
                name=name,
                model=str(new_raw.get("model", name)),
                deployment=None,
                problem=err.message,
                is_current=False,
                is_downloaded=entry is not None,
                size_bytes=entry.size_bytes if entry is not None else None,
                quantization=entry.quantization if entry is not None else "",
                served=(),
                renames="",
                plan=None,
            )
        where = self._checkpoint(deployment)
        is_current = self.current is not None and not diff(self.current, deployment)
        if kind == "template":  # the site file names it (and may override a few keys)
            is_current = is_current or self.raw.get("template") == name
        if entry is not None:
            is_current = is_current or (where is not None and where == self._current_checkpoint)
        served = served_names(deployment)
        pull_repo = None
        if where is None:
            try:
                check_repo_id(deployment.model)
                pull_repo = deployment.model
            except PullRefusedError:
                pull_repo = None
        return Candidate(
            kind=kind,
            name=name,
            model=deployment.model,
            deployment=deployment,
            problem="",
            is_current=is_current,
            is_downloaded=where is not None,
            size_bytes=self._sizes.get(where) if where is not None else None,
            quantization=entry.quantization if entry is not None else "",
            served=served,
            renames=self._renames(served),
            plan=self.plans.known(deployment, schedule=self.schedule(f"{kind}:{name}")),
            pull_repo=pull_repo,
            path=str(entry.path) if entry is not None else "",
            architecture=entry.architecture if entry is not None else None,
            source=entry.source if entry is not None else "",
        )

    def candidates(self) -> list[Candidate]:
        """Installed checkpoints first (complete ones), then the templates, in the page's order."""
        from dgpp.appliance.deployments.files import list_templates

        rows = [
            self._candidate(
                "checkpoint", entry.name, with_model(self.raw, str(entry.path), entry.name), entry
            )
            for entry in self.checkpoints
            if entry.is_complete
        ]
        for template in list_templates():
            rows.append(
                self._candidate("template", template.name, with_template(self.raw, template.name))
            )
        return rows


def warm_plans(raw: dict[str, Any], plans: PlanCache) -> int:
    """Queue every row's memory plan in the background (the console does so when it starts,
    so the Models page finds them known); how many rows there are."""
    try:
        current: Deployment | None = resolve_raw(raw, "the deployment")
    except ConfigError:
        current = None
    return len(Catalogue(raw, current, plans, schedule=lambda key: True).candidates())
