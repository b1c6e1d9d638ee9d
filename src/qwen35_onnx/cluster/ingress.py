"""The ingress of the Ray Serve application: the HTTP front (behind Ray Serve's proxy) that reads a
request, computes its conversation keys and forwards it to a chat replica through the replicas'
handle, whose router (:mod:`.routing`) picks the replica; it answers ``/health`` and ``/metrics``
for the whole application itself.

Forwarded: every route of the single-process server (``/v1/chat/completions``, ``/v1/responses``,
``/v1/messages``, ``/v1/models``, the chat page at ``/`` ...), answered by the replica's own application, so
checks, errors and streaming are the same as ``serve``'s. A Responses request that will be stored takes an id
drawn here, so that its continuations (``previous_response_id``) and ``GET`` / ``DELETE /v1/responses/{id}`` go
to the replica that stores it (:mod:`.routing`); a replica that died takes its stored responses with it (404).
Answered here:

- ``GET /health`` (no auth): :func:`~.metrics.aggregate_health`: ``ok`` / ``degraded`` / ``down``
  (503), totals, and each replica's health, process id and node.
- ``GET /metrics`` (the API key when one is set): :class:`~.metrics.ClusterMetrics`.
- 401 for a ``/v1/*`` request without the API key (before its body is read); 413 for a body over
  ``--max-body-bytes`` (before any replica is asked); 429 ``queue_full`` when
  every replica is at its limit (decode slots plus ``--max-queue``) and the router's own queue
  (``--max-queue`` more) is full.

**Faults.** When the replica dies (or cannot be reached) before its answer has begun, the request
is sent once more, to another replica (Ray's router drops the dead one; Ray Serve restarts it),
and counted in ``qwen35_onnx_cluster_retries_total``; a second failure is a 503
``replica_unavailable`` with ``Retry-After``. A non-streamed reply begins only when it is whole, so it
is always retried. A streamed reply that has begun ends with its API's error event (chat completions:
``type`` ``server_error``, code ``replica_failed``: retry the request, then ``[DONE]``); the tokens it sent
were right, it is cut short.
"""

import asyncio
import json
import logging
import re
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from ..server.chat_completions import SSE_DONE
from ..server.errors import APIError, anthropic_body
from ..server.http import authorize, install_error_handlers, read_body, sse
from ..server.options import MIB, ServerOptions
from .conversations import conversation_keys, response_key, route_counts
from .metrics import ClusterMetrics, aggregate_health
from .replica import ForwardedRequest

__all__ = ["Ingress"]

log = logging.getLogger(__name__)

REPLICA_FAILURES = (RayActorError, ActorUnavailableError)
"""What a call raises when its replica died or cannot be reached (retryable)."""

RESPONSES_PATH = "/v1/responses"
STORED_RESPONSE = re.compile(r"^/v1/responses/(?!input_tokens$)([^/]+)$")
FORWARDED_HEADERS = {
    b"authorization",
    b"x-api-key",
    b"anthropic-version",
    b"anthropic-beta",
    b"content-type",
    b"accept",
    b"host",
}
RETRY_AFTER_SECONDS = 1
"""The ``Retry-After`` of a 429 or 503 answered here."""
DROPPED_REPLY_HEADERS = {b"content-length", b"transfer-encoding", b"connection"}

app = FastAPI(title="qwen35-onnx cluster", docs_url=None, redoc_url=None, openapi_url=None)
install_error_handlers(app)


def _keys_of(path: str, body: bytes) -> tuple[tuple[bytes, ...], str | None]:
    """The request's conversation keys and, for a Responses request that will be stored, the id its response
    takes (drawn here, so the router can record which replica stores it)."""
    stored = STORED_RESPONSE.match(path)
    if stored is not None:  # GET / DELETE of a stored response: to the replica that stores it
        return (response_key(stored.group(1)),), None
    if not body:
        return (), None
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):  # the replica answers it with 400
        return (), None
    keys = conversation_keys(parsed, path)
    store = isinstance(parsed, dict) and parsed.get("store") is not False
    return keys, f"resp_{uuid.uuid4().hex}" if path == RESPONSES_PATH and store else None


class _Relay(Response):
    """A response whose status and headers came from the replica and whose body parts come as the
    replica sends them. It does not read the connection: when the client goes, Ray Serve cancels
    this request's task, which cancels the replica's call (:meth:`Ingress._relay`)."""

    def __init__(self, parts: AsyncIterator[bytes], status: int, headers: list[tuple[bytes, bytes]]):
        self.parts, self.status_code = parts, status
        self.raw_headers = list(headers)
        self.background = None

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for part in self.parts:
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _failure_events(path: str, error: APIError) -> list[str]:
    """The events that end a stream of ``path``'s API cut short by ``error``: Anthropic's ``error`` event, the
    Responses API's ``error`` event, chat completions' error chunk and ``[DONE]``."""
    if path.startswith("/v1/messages"):
        return [sse(anthropic_body(error), "error")]
    if path.startswith(RESPONSES_PATH):
        body = {"type": "error", "code": error.code, "message": error.message, "param": None, "sequence_number": 0}
        return [sse(body, "error")]
    return [sse(error.body()), SSE_DONE]


def _failure(message: str) -> APIError:
    return APIError(503, message, type="server_error", code="replica_unavailable", retry_after=RETRY_AFTER_SECONDS)


@serve.ingress(app)
class Ingress:
    """The application's HTTP front: forwards to ``replicas`` (the chat replicas' handle), reads
    ``board`` (the :class:`~.replica.StatsBoard` handle); ``options`` the server options (body
    limit, API key), ``expected`` the replicas configured."""

    def __init__(self, replicas, board, options: ServerOptions, expected: int):
        self.replicas = replicas.options(stream=True)
        self.board = board
        self.options = options
        self.expected = expected
        self._reports: dict[str, dict] = {}
        self.metrics = ClusterMetrics(lambda: self._reports, route_counts)

    async def _read_reports(self) -> dict[str, dict]:
        self._reports = await self.board.reports.remote()
        return self._reports

    @app.get("/health")
    async def health(self):
        state = aggregate_health(await self._read_reports(), self.expected)
        return JSONResponse(state, status_code=503 if state["status"] == "down" else 200)

    @app.get("/metrics")
    async def metrics(self, request: Request):
        authorize(request, self.options.api_key)
        await self._read_reports()
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"])
    async def forward(self, request: Request):
        try:
            return await self._forward(request)
        except APIError as exc:
            self.metrics.requests.labels(str(exc.status)).inc()
            raise

    async def _forward(self, request: Request) -> Response:
        path = request.url.path
        if path.startswith("/v1/"):  # before the body is read: a request without the key costs nothing
            authorize(request, self.options.api_key)
        body = await read_body(request, self.options.max_body_bytes)
        keys, response_id = await asyncio.to_thread(_keys_of, path, body) if len(body) > MIB else _keys_of(path, body)
        forwarded = ForwardedRequest(
            method=request.method,
            path=path,
            query=request.url.query.encode(),
            headers=tuple((k, v) for k, v in request.headers.raw if k.lower() in FORWARDED_HEADERS),
            body=body,
            conversation=keys,
            response_id=response_id,
        )
        for attempt in (1, 2):
            stream = self.replicas.chat.remote(forwarded)
            try:
                _, status, headers = await stream.__anext__()
                break
            except BackPressureError:
                stream.cancel()
                raise APIError(
                    429,
                    "the server is busy: every replica is at its limit (decode slots and --max-queue) and the router's "
                    "queue is full; retry later",
                    code="queue_full",
                    retry_after=RETRY_AFTER_SECONDS,
                ) from None
            except DeploymentUnavailableError:
                stream.cancel()
                raise _failure("no chat replica is running (Ray Serve is starting or restarting them); retry") from None
            except REPLICA_FAILURES as exc:
                stream.cancel()
                if attempt == 2:
                    raise _failure(
                        f"two replicas failed before answering ({type(exc).__name__}); Ray restarts them: retry the "
                        "request"
                    ) from None
                log.warning(
                    "%s %s: the replica failed before answering (%s); sending it to another",
                    request.method,
                    path,
                    type(exc).__name__,
                )
                self.metrics.retries.inc()
            except BaseException:  # the client went (Ray cancels this task), or a replica's bug
                stream.cancel()
                raise
        headers = [(k, v) for k, v in headers if k.lower() not in DROPPED_REPLY_HEADERS]
        events = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers)
        return _Relay(self._relay(stream, events, path), status, headers)

    async def _relay(self, stream, events: bool, path: str) -> AsyncIterator[bytes]:
        """The body parts of ``stream`` (a replica's answer that has begun); a replica that fails
        now ends an event stream with an error event (a plain body is cut off)."""
        try:
            async for _, part in stream:
                yield part
        except REPLICA_FAILURES as exc:
            self.metrics.requests.labels("503").inc()
            if not events:
                raise
            log.warning("the replica failed mid-stream (%s)", type(exc).__name__)
            error = _failure(
                f"the replica serving this reply failed mid-stream ({type(exc).__name__}); the text sent so far is "
                "correct but cut short: retry the request"
            )
            error.code = "replica_failed"
            for event in _failure_events(path, error):
                yield event.encode()
        finally:
            stream.cancel()
