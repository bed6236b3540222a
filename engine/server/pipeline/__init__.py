"""The one request path that every API route runs: `ServerState` (`state`), the prompt
(`chat_prompt`), sampling parameters (`api_sampling`), forced tool choice and grammars
(`tool_choice`, `structured`), the per-request output parser (`response_parser`), and running the
`n` choices whole or streamed on the `AsyncEngine` (`pipeline`, `generation`).

May import every other package of the server except `routes`. The map: docs/engine.md.
"""
