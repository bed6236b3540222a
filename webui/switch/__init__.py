"""The safe switch that every change goes through: the switcher (`switcher`), its jobs and their
SQLite log (`job`, `log`), the chart marks (`marks`), and the one-line root cause of a failed rank 0
(`root_cause`).

May import `monitor` and `deployments`. The map: docs/engine.md.
"""
