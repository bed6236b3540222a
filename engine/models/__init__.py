"""Model architectures, one module per family, keyed by the `architectures[0]` name of a
checkpoint's config.json (`registry`).

May import `vision`, `layers` and below. The map: docs/engine.md.
"""
