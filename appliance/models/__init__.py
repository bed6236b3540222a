"""Checkpoints: references and the store (`store`: `dgpp model list/pull/install-default`), the
built-in default model (`default`), and the shipped architecture facts used for plans before
download (`facts`).

May import `common`. The map: docs/engine.md.
"""
