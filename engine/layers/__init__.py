"""Tensor-parallel-ready building blocks shared by every model architecture, one module per
layer kind: linears, norms, rotary, attention kinds (paged, MLA, DSA, QSA, windows, DeepSeek-V4's
compressed keys), MoE, linear-attention states.

May import `backends` and below. The map: docs/engine.md.
"""
