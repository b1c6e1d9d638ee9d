"""Errors of the server's routes, without HTTP: :class:`APIError` carries the status, the message, the field
(``param``) and a code; each API writes it in its own shape (:func:`openai_body` for chat completions and
Responses, :func:`anthropic_body` for Anthropic Messages), and :func:`body_for_path` picks the shape of a path.

Shapes (the APIs' published error objects):

- OpenAI: ``{"error": {"message", "type", "param", "code"}}``;
- Anthropic: ``{"type": "error", "error": {"type", "message"}}`` with the error types Anthropic names by status
  (``invalid_request_error`` 400 / 413 / 422, ``authentication_error`` 401, ``not_found_error`` 404,
  ``request_too_large`` 413, ``rate_limit_error`` 429, ``api_error`` 500, ``overloaded_error`` 503 / 529); the
  field is named at the start of the message (Anthropic's objects have no ``param``).
"""

from __future__ import annotations

__all__ = ["APIError", "ANTHROPIC_PATHS", "anthropic_body", "bad_request", "body_for_path", "openai_body"]

ANTHROPIC_PATHS = ("/v1/messages",)
"""Path prefixes answered in Anthropic's shape."""


class APIError(Exception):
    """An error answered with HTTP ``status`` (and a ``Retry-After`` header of ``retry_after`` seconds when
    given): ``message`` for people, ``param`` the request field at fault (None: the whole request), ``code`` a
    stable word for programs, ``type`` OpenAI's error type."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
        retry_after: int | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.retry_after = retry_after  # seconds, sent as a Retry-After header

    def body(self) -> dict:
        """OpenAI's shape (:func:`openai_body`)."""
        return openai_body(self)


def bad_request(message: str, param: str | None = None) -> APIError:
    """A 400 ``invalid_request_error`` naming ``param`` (the field) when given."""
    return APIError(400, message, param, "invalid_value" if param else None)


def openai_body(error: APIError) -> dict:
    """``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": error.message, "type": error.type, "param": error.param, "code": error.code}}


_ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_body(error: APIError) -> dict:
    """``{"type": "error", "error": {"type", "message"}}``: the type by status (5xx ``api_error``, other 4xx
    ``invalid_request_error``); the message begins with the field when it does not name it already."""
    kind = _ANTHROPIC_TYPES.get(error.status) or ("api_error" if error.status >= 500 else "invalid_request_error")
    message = error.message
    if error.param and error.param not in message:
        message = f"{error.param}: {message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


def body_for_path(path: str, error: APIError) -> dict:
    """``error`` in the shape of the API that serves ``path``."""
    return anthropic_body(error) if path.startswith(ANTHROPIC_PATHS) else openai_body(error)
