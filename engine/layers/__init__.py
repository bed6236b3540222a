"""Tensor-parallel-ready building blocks shared by every model architecture."""
