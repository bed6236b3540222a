"""The engine's typed configuration: every knob declared once (`knobs`: the deployment schema,
the CLI flags, the console's form and the docs derive from it), the frozen `EngineConfig` a
deployment resolves to (`engine_config`), and a rank's place in the tensor-parallel world
(`parallel`).

May import `checkpoint`, `quant` and the errors. The map: docs/engine.md.
"""
