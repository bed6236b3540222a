"""Everything one running console holds, built once from its settings by `create_app`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dgpp.appliance.control.backend import BackendKind, ControlBackend
from dgpp.appliance.control.local import LocalBackend
from dgpp.appliance.control.systemd import SystemdBackend
from dgpp.appliance.deployments.deployment import Deployment
from dgpp.webui.core.config import ConsoleConfig
from dgpp.webui.deployments.store import DeploymentStore, engine_target
from dgpp.webui.models.pull import PullManager
from dgpp.webui.monitor.engine_client import EngineApi, EngineClient
from dgpp.webui.monitor.history import HistoryStore
from dgpp.webui.monitor.node_health import NodeDoctor
from dgpp.webui.monitor.node_probe import NvmlProbe
from dgpp.webui.plans.cache import PlanCache
from dgpp.webui.security.credentials import Credentials, load_credentials
from dgpp.webui.security.login_limiter import LoginLimiter
from dgpp.webui.security.sessions import SessionStore, credentials_tag
from dgpp.webui.switch.log import SwitchLog
from dgpp.webui.switch.switcher import Switcher, SwitchTimeouts


@dataclass
class Console:
    config: ConsoleConfig
    store: DeploymentStore
    backend: ControlBackend
    history: HistoryStore
    switcher: Switcher
    sessions: SessionStore
    limiter: LoginLimiter
    gpus: NvmlProbe
    credentials_path: Path
    plans: PlanCache = field(default_factory=PlanCache)  # memory plans, kept once drawn
    pulls: PullManager = field(default_factory=PullManager)  # checkpoint downloads
    doctor: NodeDoctor = field(default_factory=NodeDoctor)  # this node's `dgpp doctor`, kept

    def credentials(self) -> Credentials:
        """Read at every login, so `dgpp webui set-password` needs no console restart."""
        return load_credentials(self.credentials_path)

    def credentials_tag(self) -> str:
        """Which credentials are current: sessions opened under others are void."""
        return credentials_tag(self.credentials_path)

    def engine_for(self, deployment: Deployment) -> EngineApi:
        target = engine_target(deployment, self.config.engine_url)
        return EngineClient(target, self.config.engine_timeout_s)


def build_console(config: ConsoleConfig, backend: ControlBackend | None = None) -> Console:
    state_dir = config.state_dir
    state_dir.mkdir(parents=True, exist_ok=True)
    store = DeploymentStore(config.deployment, state_dir / "deployments")
    return Console(
        config=config,
        store=store,
        backend=backend
        or make_backend(config.backend, config.deployment, state_dir, tuple(config.systemctl)),
        history=HistoryStore(
            state_dir / "history.sqlite", config.history_retention_s, config.history_max_rows
        ),
        switcher=Switcher(
            store,
            SwitchLog(state_dir / "switches.sqlite"),
            SwitchTimeouts(config.drain_timeout_s, config.ready_timeout_s, config.poll_interval_s),
        ),
        sessions=SessionStore(config.session_ttl_s, path=state_dir / "sessions.sqlite"),
        limiter=LoginLimiter(config.login_max_failures, config.login_window_s),
        gpus=NvmlProbe(),
        credentials_path=config.credentials,
        plans=PlanCache(store=state_dir / "plans"),
    )


def make_backend(
    kind: BackendKind,
    deployment_path: Path,
    state_dir: Path,
    systemctl: tuple[str, ...] = ("systemctl",),
) -> ControlBackend:
    """The backend the console's settings name."""
    if kind == "systemd":
        return SystemdBackend(deployment_path, systemctl=systemctl)
    return LocalBackend(deployment_path, output_path=state_dir / "rank0.log")
