"""Each model family's tool-call and reasoning format, one module per family (`deepseek`, `dsml`,
`glm`, `harmony`, `kimi`, `minimax`, `qwen_xml`); which format a served model writes
(`output_format`); and the per-choice parser that runs it (`output_parser`).

May import `parsers` only. The map: docs/engine.md.
"""
