"""One running console: its settings (`config`: `ConsoleConfig`), `Console` (`console`: everything
it holds, built once by `create_app`), and the check that `engine_url` names the engine its backend
runs (`engine_address`).

May import every package except `routes`. The map: docs/engine.md.
"""
