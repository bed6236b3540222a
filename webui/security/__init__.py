"""Who may use the console: the credentials file, sessions, CSRF tokens and login throttling.

Imports nothing else of the console. The map: docs/engine.md.
"""
