"""What the console watches of the running engine: rank 0's HTTP API (`engine_client`), every node's
readings (`node_probe`), and the metric sampler with its SQLite history and per-interval latency
quantiles (`metrics_poller`, `history`, `latency_histogram`).

May import `deployments`. The map: docs/engine.md.
"""
