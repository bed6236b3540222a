"""Attention backends: each owns one kind of cache's per-step metadata and the kernels that read
and write that cache. The model runner knows only `AttentionBackend`. The caches' layouts live
here too: what each layer declares (`cache_spec`: paged keys and values, MLA latents, indexer
keys) and the recurrent states' slots and pools (`state_cache`), from which the memory plan
sizes one pool per kind.

May import `configuration`, `checkpoint` and below, and `dgpp.kernels`. The map:
docs/engine.md.
"""
