"""The OpenAI Responses API: its request body (`protocol`), input items converted to chat messages
(`convert`), output items and stream events (`output`), and the store of earlier responses
(`store`).

May import `openai`, `core` and `tool_formats`. The map: docs/engine.md.
"""
