"""Quantized checkpoints: formats, readers and packed weights (docs/quantization.md).

May import the errors and `dgpp.kernels`. The map: docs/engine.md.
"""
