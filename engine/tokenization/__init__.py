"""Text to token ids and back: the checkpoint's tokenizer and end-of-sequence ids
(`tokenizer`), DeepSeek-V4's chat encoding where its checkpoint ships no Jinja template
(`chat_dsv4`: the tokenizer's chat rendering calls it, so it sits here rather than beside the
server's chat rendering, which sits above the engine), and the incremental detokenizer that
turns a request's tokens into streamed text and finds stop strings (`detokenizer`).

May import `checkpoint` and the errors. The map: docs/engine.md.
"""
