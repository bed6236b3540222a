"""A request's scheduling priority (`SamplingParams.priority`, lower runs first) as the API
gives it: the body's `priority` (OpenAI Chat Completions, Completions, Responses, as vLLM takes
it), else the `x-dgpp-priority` header (every route; Anthropic's schema has no such field), else
the default of the API key it came with (`http.api_keys`), else 0.

A key may also carry a limit: the most urgent priority its requests may ask for. A request asking
for more is clamped to it and logged (by the key's name), not refused: agents cannot change what
they send, and a CI agent's key set to run in the background cannot raise itself.
"""

from __future__ import annotations

import hmac
import logging
from dataclasses import dataclass

from starlette.requests import Request

from dgpp.engine.errors import InvalidRequestError
from dgpp.engine.sampling.sampling_params import PRIORITY_RANGE

log = logging.getLogger(__name__)

HEADER = "x-dgpp-priority"


@dataclass(frozen=True)
class KeyPolicy:
    """An API key beside `http.api_key_file`'s, with its requests' default priority and the
    most urgent one they may ask for (None: any)."""

    name: str
    key: str = ""
    priority: int = 0
    priority_limit: int | None = None

    def __repr__(self) -> str:  # never the key itself
        return f"KeyPolicy({self.name!r}, priority={self.priority}, limit={self.priority_limit})"


def presented_key(request: Request) -> str:
    """The key a client sent: `Authorization: Bearer` (OpenAI) or `x-api-key` (Anthropic)."""
    bearer = request.headers.get("authorization", "")
    if bearer.lower().startswith("bearer "):
        return bearer[7:].strip()
    return request.headers.get("x-api-key") or ""


def key_matches(presented: str, key: str) -> bool:
    return hmac.compare_digest(presented.encode(), key.encode())


def policy_of(policies: tuple[KeyPolicy, ...], request: Request) -> KeyPolicy | None:
    presented = presented_key(request)
    if not presented:
        return None
    return next((p for p in policies if key_matches(presented, p.key)), None)


def _header_priority(request: Request) -> int | None:
    raw = request.headers.get(HEADER)
    if raw is None:
        return None
    low, high = PRIORITY_RANGE
    try:
        value = int(raw.strip())
    except ValueError:
        value = None
    if value is None or not low <= value <= high:
        raise InvalidRequestError(
            f"the {HEADER} header must be an integer in [{low}, {high}], got {raw[:32]!r}",
            param=HEADER,
        )
    return value


def request_priority(
    policies: tuple[KeyPolicy, ...], request: Request, requested: int | None = None
) -> int:
    """The priority a request runs at (see the module docstring); `requested`: the body's."""
    policy = policy_of(policies, request)
    if requested is None:
        requested = _header_priority(request)
    if requested is None:
        return policy.priority if policy is not None else 0
    limit = None if policy is None else policy.priority_limit
    if limit is not None and requested < limit:
        assert policy is not None
        log.info(
            "key %s asked for priority %d, above its limit: runs at %d",
            policy.name,
            requested,
            limit,
        )
        return limit
    return requested
