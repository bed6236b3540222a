"""Vision encoders of the vision-language families (images to the tokens that stand in for
them): images decoded and processed, their spans in a prompt (positions, chunks, cache keys),
the encoder and its cache, and what the runner asks of them.

May import `layers` and below. The map: docs/engine.md.
"""
