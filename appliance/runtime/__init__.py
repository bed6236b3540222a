"""A rank's process at run time: rank 0's head (`head`: HTTP port, world generations), local worker
processes and their watchdog (`local_workers`, `local_watchdog`), `sd_notify`, stop signals
(`stop_signals`), live knob reload (`live_reload`), the access log (`http_access_log`), node probes
(`node_probe`), and the cluster secret (`cluster_secret_file`).

May import `deployments` and `common`. The map: docs/engine.md.
"""
