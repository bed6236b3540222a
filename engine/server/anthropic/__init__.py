"""Anthropic Messages: request bodies (`protocol`), and their conversion into the chat layer's
messages and OpenAI-style tools (`convert`).

May import `openai`. The map: docs/engine.md.
"""
