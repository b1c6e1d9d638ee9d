"""The HTTP plumbing every route shares (the single server's and the cluster's ingress): the API key, the body
within its limit, server-sent events, a streaming response that ends its generation however it ends, and the
error handlers that answer in the shape of each route's API (:mod:`.errors`)."""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from .errors import APIError, bad_request, body_for_path

log = logging.getLogger(__name__)

__all__ = ["EventStream", "JSONBody", "authorize", "error_response", "install_error_handlers", "read_body", "sse"]


class JSONBody(JSONResponse):
    """A JSON response as Starlette writes it (UTF-8), with non-ASCII escaped where the content holds text
    UTF-8 cannot carry (a lone surrogate a request sent as ``\\ud800`` and a reply echoes)."""

    def render(self, content) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, separators=(",", ":"), allow_nan=False).encode()


def sse(payload, event: str | None = None) -> str:
    """One server-sent event carrying ``payload`` as compact JSON (with an ``event:`` line when given)."""
    data = f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
    return data if event is None else f"event: {event}\n{data}"


class EventStream(StreamingResponse):
    """``text/event-stream`` response that calls ``on_exit`` however the response ends (finished, client gone,
    server shutting down): it cancels the generation."""

    def __init__(self, content: AsyncIterator[str], on_exit: Callable[[], None]):
        super().__init__(
            content, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self._on_exit = on_exit

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_exit()


def authorize(request: Request, key: str | None) -> None:
    """Raises APIError 401 ``invalid_api_key`` unless ``request`` carries ``Authorization: Bearer <key>`` or
    ``x-api-key: <key>`` (Anthropic's header), compared in constant time; nothing when ``key`` is None."""
    if key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    sent = token.strip() if scheme.lower() == "bearer" else request.headers.get("x-api-key", "").strip()
    if not hmac.compare_digest(sent.encode(), key.encode()):
        raise APIError(
            401,
            "missing or wrong API key: send Authorization: Bearer <key> (or x-api-key: <key>)",
            code="invalid_api_key",
        )


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body of ``request``, at most ``limit`` bytes.

    Raises:
        APIError: 413 ``request_too_large`` over ``limit`` (by Content-Length before reading, or
            while reading); 400 for a Content-Length that is not a number or a client gone mid-body.
    """
    too_large = f"more than the limit of {limit} bytes (--max-body-bytes)"
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise bad_request(f"Content-Length {length[:40]!r} is not a number")
        if int(length) > limit:
            raise APIError(413, f"the request body is {int(length)} bytes, {too_large}", code="request_too_large")
    body = bytearray()
    try:
        async for part in request.stream():
            body += part
            if len(body) > limit:
                raise APIError(413, f"the request body is {too_large}", code="request_too_large")
    except ClientDisconnect:
        raise bad_request("the client disconnected before sending the whole body") from None
    return bytes(body)


def error_response(path: str, error: APIError) -> JSONResponse:
    """``error`` as a response in the shape of ``path``'s API (with ``Retry-After`` when it has one)."""
    headers = None if error.retry_after is None else {"Retry-After": str(error.retry_after)}
    return JSONBody(body_for_path(path, error), status_code=error.status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    """Answer ``app``'s errors in the shape of each path's API: :class:`APIError` as raised, FastAPI's
    validation errors as 400, Starlette's HTTP errors (404, 405) with their status, anything else as a logged 500
    ``internal_error``."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return error_response(request.url.path, exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return error_response(request.url.path, bad_request(first.get("msg", "invalid request"), param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return error_response(request.url.path, APIError(exc.status_code, message, code=code))

    @app.exception_handler(Exception)
    async def server_bug(request: Request, exc: Exception):
        log.error("unexpected error in %s %s", request.method, request.url.path, exc_info=exc)
        error = APIError(500, "internal server error (logged)", type="server_error", code="internal_error")
        return error_response(request.url.path, error)
