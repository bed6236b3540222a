"""One router per resource of the console (auth, overview, models, knobs, switch, logs), their typed
dependencies (`deps`) and page rendering (`pages`).

May import everything but the top (`app`, `cli`). The map: docs/engine.md.
"""
