"""The `dgpp` subcommands that `cli.py` dispatches to (`cache`, `deploy`, `eval`, `generate`,
`rank`, `serve`), the command-line flags derived from the knobs (`engine_options`), and the CLI's
environment overrides of deadlines (`timeout_env`).

May import everything below it, and `offline`. The map: docs/engine.md.
"""
