"""What a rank will hold and where, decided before anything loads: the memory plan
(`memory_plan`, with the device's memory and locking it: `device_memory`, `memory_lock`), the
weights' bytes (`weight_count`), the configuration resolved against the checkpoint and the
memory (`resolved`), the layouts of the recurrent states and of the prefix cache's tiers
(`state_plan`, `host_store`, `tier_layout`), and the resident weight images a restart loads in
seconds (`resident_cache`).

May import `cache` and everything below it. The map: docs/engine.md.
"""
