"""The HTTP front of rank 0: OpenAI-compatible routes over an `AsyncEngine`."""
