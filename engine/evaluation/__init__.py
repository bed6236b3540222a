"""Scoring text with the engine: a text's windows through prefill with score sinks
(`eval_scoring`: `dgpp eval perplexity`), reference files for `dgpp eval kld`
(`eval_reference`), and teacher-forced logits for parity tests (`teacher_force`).

May import the front (`dgpp.engine.engine`) and everything below it. The map: docs/engine.md.
"""
