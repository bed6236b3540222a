"""Caps request bodies, chunked ones included: `Content-Length` alone can be absent or lie."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dgpp.engine.server.core.errors import APIError, error_response
from dgpp.engine.server.metrics.service import record_error


class BodyLimitMiddleware:
    """Counts body bytes as the app reads them. Past `limit` it answers 413 itself (in the API's
    error shape), tells the app the client left, and drops whatever the app tries to send after.
    Raising instead would not work: FastAPI turns body-reading errors into a generic 400."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        received = 0
        refused = False

        async def limited_receive() -> Message:
            nonlocal received, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    refused = True
                    error = APIError(
                        413, f"request body over {self.limit} bytes", code="request_too_large"
                    )
                    record_error(scope, error.status, error.code)
                    await error_response(error, scope["path"])(scope, receive, send)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            if not refused:
                await send(message)

        await self.app(scope, limited_receive, guarded_send)
