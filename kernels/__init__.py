"""Compute kernels: each Triton kernel has a PyTorch twin with the same signature."""
