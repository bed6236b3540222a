"""Choosing tokens from logits: a request's parameters (`sampling_params`) and the checkpoint's
recommended defaults (`sampling_defaults`), the batched sampler with its logprobs (`sampler`),
structured outputs' grammars (`grammar`, llguidance) and the reasoning budget
(`reasoning_budget`).

May import `configuration`, `tokenization`, `checkpoint` and the errors. The map:
docs/engine.md.
"""
