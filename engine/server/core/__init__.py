"""What every part of the HTTP server shares: its settings (`config`: `ServerConfig`, from the
knobs), the one mapping from any error to an OpenAI-style error body (`errors`), and the
request-body cap (`body_limit`).

May import `metrics` and the engine. The map: docs/engine.md.
"""
