"""A deployment's log folder, `~/dgpp/log/deployments/<id>/`: the resolved configuration rank 0
ran (`deployment.json`) and one log file per rank (`rank<N>.log`), beside the journal."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from dgpp.appliance.common.log_format import RankLogFormatter
from dgpp.appliance.common.paths import deployment_log_dir
from dgpp.appliance.deployments.deployment import Deployment
from dgpp.appliance.deployments.files import deployment_id, deployment_json

log = logging.getLogger(__name__)


def record_deployment(deployment: Deployment) -> tuple[str, Path | None]:
    """Write the resolved deployment into its folder; (id, folder), folder None if unwritable
    (logging to files is a convenience: it never stops a rank)."""
    ident = deployment_id(deployment)
    folder = deployment_log_dir(ident)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        target = folder / "deployment.json"
        temporary = folder / f".deployment.json.{os.getpid()}"
        temporary.write_text(deployment_json(deployment))
        os.replace(temporary, target)
    except OSError as err:
        log.warning("cannot write the deployment log folder %s: %s", folder, err)
        return ident, None
    return ident, folder


def attach_rank_log(deployment: str, rank: int) -> logging.FileHandler | None:
    """Also log this rank's records to `<folder>/rank<rank>.log`; the handler, or None."""
    folder = deployment_log_dir(deployment)
    path = folder / f"rank{rank}.log"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(path)
    except OSError as err:
        log.warning("cannot log to %s: %s", path, err)
        return None
    handler.setFormatter(RankLogFormatter(rank))
    logging.getLogger().addHandler(handler)
    return handler


def follow_deployment(old: str | None, new: str, rank: int) -> None:
    """This rank now runs deployment `new` (its first, `old` None; a switch; a live reload):
    log to its folder (`attach_rank_log`) instead of `old`'s."""
    if old == new:
        return
    root = logging.getLogger()
    if old is not None:
        folder = str(deployment_log_dir(old))
        for handler in list(root.handlers):
            if isinstance(handler, logging.FileHandler) and handler.baseFilename.startswith(
                folder + os.sep
            ):
                root.removeHandler(handler)
                handler.close()
    attach_rank_log(new, rank)
