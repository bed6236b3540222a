"""The HTTP front of rank 0: OpenAI- and Anthropic-compatible routes over an `AsyncEngine`.

May import every other part of the engine (it sits on top). The map: docs/engine.md.
"""
