"""One mapping from every error to an OpenAI-style body: {"error": {message, type, param, code}}."""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from dgpp.engine.async_engine import EngineFailureError, OverloadedError
from dgpp.engine.errors import ContextLengthExceededError, DgppError, InvalidRequestError
from dgpp.engine.server.metrics.service import record_error

RETRY_AFTER_SECONDS = "5"
log = logging.getLogger(__name__)


class APIError(Exception):
    """An error the API reports as it is (status, type, code, param)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param
        self.headers = headers


class ClientDisconnected(Exception):
    """The client of a whole (non-streamed) response went away; its work was aborted."""


CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before the answer


def error_body(message: str, type_: str, code: str | None, param: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def from_dgpp_error(err: DgppError) -> APIError:
    """The HTTP form of an engine error."""
    if isinstance(err, OverloadedError):
        return APIError(
            503,
            err.message,
            type_="overloaded_error",
            code="overloaded",
            headers={"Retry-After": RETRY_AFTER_SECONDS},
        )
    if isinstance(err, EngineFailureError):
        return APIError(
            503,
            err.message,
            type_="server_error",
            code="engine_failure",
            headers={"Retry-After": RETRY_AFTER_SECONDS},
        )
    if isinstance(err, ContextLengthExceededError):
        return APIError(400, err.message, code="context_length_exceeded", param=err.param)
    if isinstance(err, InvalidRequestError):
        return APIError(400, err.message, code="invalid_value", param=err.param)
    return APIError(500, err.message, type_="server_error", code=err.code)


ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def anthropic_body(err: APIError) -> dict[str, Any]:
    kind = ANTHROPIC_TYPES.get(err.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def error_response(err: APIError, path: str = "") -> JSONResponse:
    """The error in the shape of the API `path` belongs to: Anthropic's, or OpenAI's."""
    body = (
        anthropic_body(err)
        if is_anthropic_path(path)
        else error_body(err.message, err.type, err.code, err.param)
    )
    return JSONResponse(body, status_code=err.status, headers=err.headers)


TYPE_ERROR_SUFFIXES = ("_type", "_parsing")


def _param_of(location: tuple[Any, ...]) -> str | None:
    """The request field a pydantic error location names. Locations through a union carry the
    branch's type tag ('str', 'list[int]', 'ContentPart', 'function-after[...]'): those are
    dropped, so `stop: 7` names `stop`, not `stop.str`."""
    parts = []
    for part in location:
        if part == "body":
            continue
        if isinstance(part, int):
            parts.append(str(part))
            continue
        text = str(part)
        if text in TYPE_TAGS or "[" in text or "-" in text or text[:1].isupper():
            continue
        parts.append(text)
    return ".".join(parts) or None


TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none", "tuple"})


def _validation_error(err: RequestValidationError) -> APIError:
    first = err.errors()[0] if err.errors() else {}
    param = _param_of(tuple(first.get("loc", ())))
    kind = first.get("type", "")
    if kind == "json_invalid":
        return APIError(400, "the request body is not valid JSON", code="invalid_json")
    if param is None:
        return APIError(
            400,
            "the request body must be a JSON object (send it with Content-Type: application/json)",
            code="invalid_json",
        )
    if kind == "missing":
        message = f"missing required parameter: {param}"
        return APIError(400, message, code="missing_required_parameter", param=param)
    detail = first.get("msg", "invalid value")
    # A value of the right type outside its range or choices is an invalid value, not a type error.
    code = "invalid_type" if kind.endswith(TYPE_ERROR_SUFFIXES) else "invalid_value"
    return APIError(400, f"{param}: {detail}", code=code, param=param)


def _undecodable(cause: BaseException | None) -> str:
    """Why FastAPI could not decode a JSON body, in the client's terms."""
    if isinstance(cause, RecursionError):
        return (
            "the request body nests JSON arrays and objects too deeply to parse "
            "(at most about 1,000 levels)"
        )
    if isinstance(cause, UnicodeDecodeError):
        return "the request body is not valid JSON: it is not UTF-8 text"
    return f"the request body could not be decoded as JSON ({type(cause).__name__})"


def respond(request: Request, err: APIError) -> JSONResponse:
    """The error response, counted in the app's service metrics when a generation route failed,
    and logged with its reason (an access log says only the status)."""
    record_error(request.scope, err.status, err.code)
    log.info(
        "%d %s on %s %s: %s", err.status, err.code, request.method, request.url.path, err.message
    )
    return error_response(err, request.url.path)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError) -> JSONResponse:
        return respond(request, err)

    @app.exception_handler(DgppError)
    async def _dgpp_error(request: Request, err: DgppError) -> JSONResponse:
        return respond(request, from_dgpp_error(err))

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, err: ClientDisconnected) -> Response:
        # Nobody reads this; the request was counted as cancelled where it was aborted.
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, err: RequestValidationError) -> JSONResponse:
        return respond(request, _validation_error(err))

    @app.exception_handler(json.JSONDecodeError)
    async def _bad_json(request: Request, err: json.JSONDecodeError) -> JSONResponse:
        message = f"the request body is not valid JSON: {err}"
        return respond(request, APIError(400, message, code="invalid_json"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, err: StarletteHTTPException) -> JSONResponse:
        codes = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
        message = str(err.detail)
        if err.status_code == 400:
            # FastAPI's only 400: a JSON body it could not decode, the reason in its cause.
            codes[400] = "invalid_json"
            message = _undecodable(err.__cause__)
        return respond(
            request,
            APIError(
                err.status_code,
                message,
                code=codes.get(err.status_code),
                headers=getattr(err, "headers", None),
            ),
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, err: Exception) -> JSONResponse:
        # The client learns that it failed and under which id; what failed (exception text,
        # paths, traceback) goes to the log only.
        error_id = f"err-{uuid.uuid4().hex[:16]}"
        log.error(
            "internal error %s on %s %s", error_id, request.method, request.url.path, exc_info=err
        )
        return respond(
            request,
            APIError(
                500,
                f"internal server error (id {error_id}); the server log has the details",
                type_="server_error",
                code="internal_error",
                headers={"x-request-id": error_id},
            ),
        )
