"""The HTTP front of rank 0: OpenAI- and Anthropic-compatible routes over an `AsyncEngine`.

In packages, bottom first (`tests/test_imports.py: SERVER_LAYERS`): `metrics` and `parsers`,
`core` and `tool_formats`, `openai`, then `chat`, `anthropic` and `responses`, `pipeline`,
`routes`, and `app` on top. May import every other part of the engine (it sits on top). The
map: docs/engine.md.
"""
