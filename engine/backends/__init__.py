"""Attention backends: each owns one kind of cache's per-step metadata and the kernels that read
and write that cache. The model runner knows only `AttentionBackend`."""
