"""Where keys, values and recurrent states live between steps and requests: the block manager
(block tables, reference counts, `match_prefix`), the prefix cache's hash-chained blocks
(`prefix_cache`), the hybrid families' state snapshots (`state_snapshots`), and the tiers below
the device pool: host memory (`host_tier`) and the node's disk (`disk_tier`, `disk_store`,
`tier_file`), with the snapshots' own (`snapshot_tiers`). The pools' layouts are the cache
specs of `dgpp.engine.backends`.

May import `models` and everything below it (`vision`'s image spans key blocks); the request
record only as an annotation. The map: docs/engine.md.
"""
