"""Errors in the shape of the route's API.

Every client mistake becomes an `APIError` (4xx) and is answered in its
route's shape: OpenAI's `{"error": {"message", "type", "param", "code"}}`
unless a dialect registered its own shape for its paths (`ErrorShapes`).
The handlers here also turn FastAPI/Starlette's own errors (404, 405,
validation) into it, so no client ever sees a bare 422 or 500 page.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error answered to the client with `status` and the OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The OpenAI error body (the default shape)."""
        return error_body(self.message, self.type, self.param, self.code)


ErrorShape = Callable[[APIError], dict[str, Any]]


class ErrorShapes:
    """The error body each path answers: a dialect's shape under its path prefix, else OpenAI's.

    Every error response goes through `response`; `on_error` (the status board) hears of each.
    """

    def __init__(
        self,
        by_prefix: Mapping[str, ErrorShape] | None = None,
        on_error: Callable[[APIError, str], None] | None = None,
    ) -> None:
        self._by_prefix = dict(by_prefix or {})
        self.on_error = on_error

    def response(self, error: APIError, path: str) -> JSONResponse:
        if self.on_error is not None:
            self.on_error(error, path)
        shape: ErrorShape = APIError.body
        for prefix, dialect_shape in self._by_prefix.items():
            if path == prefix or path.startswith(prefix + "/"):
                shape = dialect_shape
        return JSONResponse(shape(error), status_code=error.status, headers=error.headers)


class GenerationFailed(APIError):
    """The engine failed a non-streamed request: a 500 whose run already counted it."""

    def __init__(self, message: str) -> None:
        super().__init__(500, message, type="server_error", code="generation_failed")


def bad_request(message: str, param: str | None = None) -> APIError:
    """A 400 `invalid_request_error` naming the offending field."""
    return APIError(400, message, param=param)


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _as_api_error(exc: Exception) -> APIError:
    """Any exception a route raised, as the APIError it is answered with."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, StarletteHTTPException):
        return APIError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {}))
    if isinstance(exc, RequestValidationError):
        errors = exc.errors()
        msg = str(errors[0].get("msg", "invalid request")) if errors else "invalid request"
        return APIError(400, msg)
    logger.exception("unhandled error in request", exc_info=exc)
    return APIError(500, "internal server error", code="internal_error")


def install_handlers(app: FastAPI, shapes: ErrorShapes) -> None:
    async def handle(request: Request, exc: Exception) -> JSONResponse:
        return shapes.response(_as_api_error(exc), request.url.path)

    for kind in (APIError, StarletteHTTPException, RequestValidationError, Exception):
        app.add_exception_handler(kind, handle)


def check_api_key(request: Request, api_key: str | None) -> None:
    """401 unless the request carries the key (constant-time).

    OpenAI clients send `Authorization: Bearer <key>`, Anthropic clients
    `x-api-key: <key>`; either is accepted on every route.
    """
    if api_key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    given = token.strip() if scheme.lower() == "bearer" else ""
    given = given or request.headers.get("x-api-key", "").strip()
    if not hmac.compare_digest(given.encode("utf-8"), api_key.encode("utf-8")):
        raise APIError(
            401,
            "invalid or missing API key"
            if given
            else "missing API key (Authorization: Bearer, or x-api-key)",
            code="invalid_api_key",
        )


class BodyLimitMiddleware:
    """Answer 413 when a request body exceeds `max_bytes` (declared or streamed)."""

    def __init__(self, app: ASGIApp, max_bytes: int, shapes: ErrorShapes) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.shapes = shapes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await self._reject(scope, receive, send)
                return
        seen = 0
        response_started = False

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise self._error()
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal response_started
            if message["type"] == "http.response.start":
                response_started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except APIError as e:
            if e.status != 413 or response_started:
                raise
            await self.shapes.response(e, scope.get("path", ""))(scope, receive, send)

    def _error(self) -> APIError:
        return APIError(413, f"request body exceeds {self.max_bytes} bytes", code="body_too_large")

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.shapes.response(self._error(), scope.get("path", ""))(scope, receive, send)
