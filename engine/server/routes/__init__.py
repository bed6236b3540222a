"""The FastAPI routers, one per API or resource (`chat_routes`, `completion_routes`,
`anthropic_routes`, `responses_routes`, `admin_routes`, `metrics_routes`, `misc_routes`), and their
typed dependencies (`deps`). A route turns its protocol's request into a `pipeline` job.

May import every package of the server except the top (`app`). The map: docs/engine.md.
"""
