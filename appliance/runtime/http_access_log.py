"""Rank 0's HTTP access log: uvicorn's `uvicorn.access` records, in the rank log format, with
the monitoring polls kept out of it.

The console polls rank 0 every second or two (`/health`, `/v1/metrics`, `/metrics`,
`/admin/nodes`, `/v1/models`), and so do Prometheus and load balancers; at INFO those lines
would bury everything else. A successful GET (or HEAD) of one of those paths is logged at DEBUG
(dropped unless the rank runs with `--log-level debug`), and so is `/health`'s `503`: it is the
answer "not serving yet" (loading, re-forming), which the rank's own log lines already tell, once
a second while a large model loads. A generation request, and any other request that fails (4xx,
5xx, whatever its path), stays at INFO."""

from __future__ import annotations

import logging

import uvicorn
from fastapi import FastAPI

ACCESS_LOGGER = "uvicorn.access"
MONITORING_PATHS = frozenset({"/health", "/metrics", "/v1/metrics", "/v1/models", "/admin/nodes"})
_POLL_METHODS = frozenset({"GET", "HEAD"})


def is_monitoring_poll(record: logging.LogRecord) -> bool:
    """Whether `record` is uvicorn's access line of a successful poll of a monitoring path.
    uvicorn logs `'%s - "%s %s HTTP/%s" %d'` with (client, method, path?query, version, status).
    """
    args = record.args
    if not isinstance(args, tuple) or len(args) != 5:
        return False
    _, method, target, _, status = args
    if not isinstance(target, str) or not isinstance(status, int):
        return False
    path = target.partition("?")[0]
    if method not in _POLL_METHODS or path not in MONITORING_PATHS:
        return False
    return status < 400 or (path == "/health" and status == 503)


class MonitoringPollFilter(logging.Filter):
    """On `uvicorn.access`: a monitoring poll becomes a DEBUG record, dropped here unless the
    logger is enabled for DEBUG (a filter runs after the logger's own level check, and handlers
    further up would take a demoted record as it is)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not is_monitoring_poll(record):
            return True
        if not logging.getLogger(record.name).isEnabledFor(logging.DEBUG):
            return False
        record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        return True


def quiet_monitoring_polls() -> None:
    """Install the filter on uvicorn's access logger (once, however often this is called)."""
    logger = logging.getLogger(ACCESS_LOGGER)
    if not any(isinstance(existing, MonitoringPollFilter) for existing in logger.filters):
        logger.addFilter(MonitoringPollFilter())


def http_server_config(
    app: FastAPI, host: str, port: int, log_level: str, uds: str | None = None
) -> uvicorn.Config:
    """uvicorn's settings for rank 0: no logging configuration of its own (`log_config=None`),
    so its loggers propagate to the root handlers `configure_logging` set up (standard error and
    the deployment's `rank0.log`, with timestamps), and the monitoring polls quieted. With
    `uds`, a Unix socket (owner only) in place of host:port."""
    config = uvicorn.Config(
        app, host=host, port=port, uds=uds, log_level=log_level, log_config=None
    )
    quiet_monitoring_polls()
    return config
