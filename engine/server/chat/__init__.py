"""The chat layer: message normalisation and rendering through the checkpoint's template (`render`),
the request's images and grounding coordinates (`image_inputs`, `coordinates`), and each API's
reasoning switches as template arguments (`reasoning_knobs`).

May import `openai` and `core`. The map: docs/engine.md.
"""
