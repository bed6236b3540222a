"""What the Models page offers: installed checkpoints and templates with what a switch would mean
(`catalogue`), and pulls from the hub with their cleanup (`pull`, `pull_cleanup`).

May import `plans` and `deployments`. The map: docs/engine.md.
"""
