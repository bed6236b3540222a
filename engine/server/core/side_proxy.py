"""Rank 0's front for side models (issue 67): a request whose body names a side model (by name or
alias) is forwarded, as it came, to that model's own server, and its answer streamed back as it
comes; every other request goes on to this server's routes. The front has checked the key and the
body's size already; the side server listens on a Unix socket only the front can reach.

Who runs the side models is the `SideRouter` given to the app (`app.state.dgpp_sides`;
`dgpp.appliance.runtime.side_supervisor` in `dgpp serve`): it names the side model a request is
for, and lends a ready one (loading it first, within a deadline).
"""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

import httpx
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dgpp.engine.server.core.errors import APIError, respond

log = logging.getLogger(__name__)

# The routes whose JSON body names a model (`model`)
ROUTED_PATHS = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/embeddings",
        "/v1/rerank",
        "/v2/rerank",
        "/v1/score",
        "/tokenize",
        "/detokenize",
    }
)
HOP_BY_HOP = frozenset(
    {b"connection", b"keep-alive", b"transfer-encoding", b"te", b"upgrade", b"host"}
)


class SideRouter(Protocol):
    def side_for(self, requested: str) -> str | None:
        """The side model a request for model `requested` goes to; None: this server's."""
        ...

    def lease(self, name: str) -> AbstractAsyncContextManager[httpx.AsyncBaseTransport]:
        """The side model `name`, ready (loaded first if it is not), for one request: a
        transport to its server. Raises `APIError` (503 with Retry-After while it loads past
        the wait, 502 when its load failed)."""
        ...

    def listing(self) -> list[dict[str, Any]]:
        """The side models as /v1/models lists them (with their state)."""
        ...

    def peek(self, name: str) -> httpx.AsyncBaseTransport | None:
        """A transport to side model `name` if it is loaded (never loads it, nor counts as a
        use); None otherwise."""
        ...

    async def load(self, name: str) -> None:
        """Load side model `name` now and wait for it (`lease`'s errors)."""
        ...

    def unload(self, name: str) -> bool:
        """Stop side model `name` now (blocking till it stopped); whether it was running."""
        ...


class SideProxy:
    """ASGI middleware: forwards requests for side models (see the module docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        router: SideRouter | None = None
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in ROUTED_PATHS:
            router = getattr(scope["app"].state, "dgpp_sides", None)
        if router is None:
            await self.app(scope, receive, send)
            return
        body, more = await _read_body(receive)
        requested = _model_of(body)
        side = router.side_for(requested) if requested is not None else None
        if side is None:
            await self.app(scope, _replay(body, more, receive), send)
            return
        request = Request(scope)
        try:
            async with router.lease(side) as transport:
                await _forward(scope, body, transport, receive, send)
        except APIError as err:
            await respond(request, err)(scope, receive, send)


async def _read_body(receive: Receive) -> tuple[bytes, bool]:
    """The whole body; whether the client is still there (no disconnect seen)."""
    parts = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b"".join(parts), False
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(parts), True


def _replay(body: bytes, more: bool, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        if not more:
            return {"type": "http.disconnect"}
        return await receive()

    return replay


def _model_of(body: bytes) -> str | None:
    try:
        parsed = json.loads(body)
    except ValueError:
        return None  # the route answers it with its own 400
    model = parsed.get("model") if isinstance(parsed, dict) else None
    return model if isinstance(model, str) else None


async def _forward(
    scope: Scope, body: bytes, transport: httpx.AsyncBaseTransport, receive: Receive, send: Send
) -> None:
    """Send the request to the side server and stream its answer back; a client that leaves
    closes the upstream request (the side server aborts it)."""
    headers = [
        (name, value)
        for name, value in scope["headers"]
        if name.lower() not in HOP_BY_HOP and name.lower() != b"content-length"
    ]
    path = scope["path"] + (f"?{scope['query_string'].decode()}" if scope["query_string"] else "")
    async with httpx.AsyncClient(transport=transport, base_url="http://side", timeout=None) as up:
        request = up.build_request("POST", path, headers=headers, content=body)
        relay = asyncio.ensure_future(_relay(up, request, send))
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait((relay, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not relay.done():  # the client left: closing the stream aborts upstream
                relay.cancel()
                log.info("client left; %s to a side model cancelled", scope["path"])
        if relay.done() and not relay.cancelled():
            relay.result()


async def _relay(client: httpx.AsyncClient, request: httpx.Request, send: Send) -> None:
    try:
        response = await client.send(request, stream=True)
    except httpx.TransportError as err:
        raise APIError(
            502, f"the side model did not answer: {err}", type_="server_error", code="side_failed"
        ) from None
    try:
        headers = [(k, v) for k, v in response.headers.raw if k.lower() not in HOP_BY_HOP]
        await send({"type": "http.response.start", "status": response.status_code,
                    "headers": headers})  # fmt: skip
        async for chunk in response.aiter_raw():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    finally:
        await response.aclose()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def side_get(router: SideRouter, requested: str, path: str) -> httpx.Response | None:
    """GET `path` from the side model `requested` names, if it is loaded now; None when it is
    not loaded. `APIError` 404 for a name that is no side model."""
    name = router.side_for(requested)
    if name is None:
        raise APIError(404, f"{requested!r} is not a side model", param="model", code="not_found")
    transport = router.peek(name)
    if transport is None:
        return None
    async with httpx.AsyncClient(transport=transport, base_url="http://side", timeout=10) as up:
        try:
            return await up.get(path)
        except httpx.TransportError:
            return None  # it stopped meanwhile
