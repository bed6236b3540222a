"""Service-side metrics of one app: request outcomes, token and tool-call counters, latency
histograms (`service`, `histogram`), their Prometheus exposition (`prometheus`), rank 0's memory
readings (`process_memory`) and the periodic stats log line (`stats_log`).

Imports only the engine (`scheduling.stats`, `scheduling.request`), nothing else of the server. The
map: docs/engine.md.
"""
