"""The incremental machinery for reading a model's output: tagged tool-call blocks (`tool_parser`:
`ToolCallParser`, the Hermes and Llama defaults), `<think>` reasoning (`reasoning_parser`), what a
parsed piece yields (`parsed_delta`), arguments typed by the tools' schemas (`tool_arguments`,
`xml_parameters`), and special-token stripping (`special_tokens`).

Pure text processing: imports nothing else of the server. The map: docs/engine.md.
"""
