"""The checkpoint as dgpp reads it: `config.json` (or a GGUF file's metadata) parsed into the
typed `ModelConfig` (`config`), and its weight files found and loaded into a built model
(`loader`: safetensors or GGUF, packed formats kept packed).

May import `dgpp.engine.errors`, `dgpp.engine.quant` and `dgpp.kernels`; nothing else of the
engine. Its place in the engine: docs/engine.md (the map).
"""
