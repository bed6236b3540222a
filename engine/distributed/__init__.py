"""Multi-rank worlds: process groups, rendezvous and the cluster secret, the rank-0 control
channel and a worker rank's loop (rank 0's side of the world is the front's `head`).

May import `speculative` and below. The map: docs/engine.md.
"""
