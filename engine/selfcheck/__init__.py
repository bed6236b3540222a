"""The start-up self-check of a CUDA rank: every Triton kernel the deployment dispatches against
its PyTorch twin, and one graphed decode step against an eager one (docs/operations.md)."""
