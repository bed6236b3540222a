"""The web admin console: `create_app(config)` in `dgpp.webui.app`, run by `dgpp webui`.

It reads the engine's health, models and JSON metrics, keeps a sampled history in SQLite for its
charts, and changes the appliance only by writing a validated deployment file and restarting
rank 0 through a control backend (`dgpp.appliance.control_backend`). docs/webui.md."""
