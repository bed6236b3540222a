"""Memory previews of a deployment: the engine's plan against rank 0's budget (`memory_preview`),
computed once and kept in memory and on disk (`cache`, `store`).

Imports only the appliance and the engine. The map: docs/engine.md.
"""
