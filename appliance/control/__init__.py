"""How the console controls the engine's processes: the `ControlBackend` interface (`backend`), and
its systemd and local implementations (`systemd`, `local`).

May import `deployments` and `common`. The map: docs/engine.md.
"""
