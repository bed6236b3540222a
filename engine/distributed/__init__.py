"""Multi-rank worlds: process groups, the rank-0 control channel and the worker loop."""
