"""Model architectures, keyed by the `architectures[0]` name of a checkpoint's config.json."""
