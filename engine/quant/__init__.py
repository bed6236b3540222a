"""Quantized checkpoints: formats, readers and packed weights (docs/quantization.md)."""
