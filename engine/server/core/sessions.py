"""A request's agent session (`dgpp.engine.cache.sessions`) as the API gives it, in order:
OpenAI's `prompt_cache_key` (Codex sends its conversation's), Anthropic's `metadata.user_id`
(Claude Code carries its session in it), the `x-session-id` header; else none.

Ids are opaque to dgpp. Each is scoped to the API key it came with (`<key name>/<id>`, the main
key's name being `default`), so one key's clients can neither steer nor release another's
sessions. An id longer than `MAX_RAW` characters, or with characters outside printable ASCII,
stands as a digest of itself; the log never shows an id whole (`redacted`).
"""

from __future__ import annotations

import hashlib

from starlette.requests import Request

from dgpp.engine.server.core.priority import KeyPolicy, policy_of

HEADER = "x-session-id"
MAX_RAW = 128
DEFAULT_KEY = "default"  # the name of http.api_key_file's key (and of no key at all)


def key_name(policies: tuple[KeyPolicy, ...], request: Request) -> str:
    """The name of the key the request came with (`http.api_keys`), else `default`."""
    policy = policy_of(policies, request)
    return DEFAULT_KEY if policy is None else policy.name


def bounded(raw: str) -> str:
    """`raw` as the engine keys it: itself when short and printable, else a digest."""
    text = raw.strip()
    if len(text) <= MAX_RAW and text.isascii() and text.isprintable():
        return text
    return "sha256:" + hashlib.sha256(raw.encode()).hexdigest()[:40]


def request_session(
    policies: tuple[KeyPolicy, ...],
    request: Request,
    prompt_cache_key: str | None = None,
    metadata: dict[str, object] | None = None,
) -> str | None:
    """The engine's session id of a request (see the module docstring), or None."""
    user_id = (metadata or {}).get("user_id")
    for raw in (prompt_cache_key, user_id, request.headers.get(HEADER)):
        if isinstance(raw, str) and raw.strip():
            return f"{key_name(policies, request)}/{bounded(raw)}"
    return None


def redacted(session: str) -> str:
    """An id as the log may show it: its key's name and a short digest."""
    scope, _, raw = session.partition("/")
    return f"{scope}/{hashlib.sha256(raw.encode()).hexdigest()[:8]}"
