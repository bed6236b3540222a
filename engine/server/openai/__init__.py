"""The OpenAI protocol that the other APIs build on: request models that are strict on known fields
and tolerant of unknown ones (`protocol`, `tolerant`), tool-schema checks (`tool_schema`), response
bodies (`bodies`), and prompt scoring (`prompt_scores`: `echo` plus `logprobs`).

May import `core`. The map: docs/engine.md.
"""
