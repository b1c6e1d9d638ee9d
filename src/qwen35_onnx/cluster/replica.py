"""One chat replica of the Ray Serve application: the single-process server's application
(:func:`~qwen35_onnx.server.app.create_app`: the same routes, checks, errors, scheduler and kept
states) over its own pipeline, answering the requests the ingress forwards to it.

A forwarded request is run through the application in-process as an ASGI call
(:func:`asgi_messages`): its response comes back as messages (``start`` with the status and headers,
then ``body`` parts, one per streamed event), which Ray streams to the ingress. When the ingress
cancels the call (its client went away), the application sees ``http.disconnect``, as it would
from a socket, and closes the generation between two tokens.

The replica reports its health and metrics to the board (:class:`StatsBoard`) every
:data:`REPORT_SECONDS`; the ingress's ``/health`` and ``/metrics`` read them there.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from ..pipeline import Pipeline
from ..runtime.backend import RuntimeOptions
from ..runtime.select import share_threads
from ..server.app import create_app
from ..server.options import ServerOptions
from ..server.responses import RESPONSE_ID_SCOPE

__all__ = ["FORGET_SECONDS", "REPORT_SECONDS", "ChatReplica", "ForwardedRequest", "StatsBoard", "asgi_messages"]

log = logging.getLogger(__name__)

REPORT_SECONDS = 1.0
"""How often a replica sends its health and metrics to the board."""
FORGET_SECONDS = 60.0
"""A replica silent this long is dropped from the board (and from ``/health`` and ``/metrics``)."""


@dataclass(frozen=True)
class ForwardedRequest:
    """An HTTP request the ingress passes to a replica.

    Attributes:
        method, path, query: as received (``query`` the raw query string, bytes).
        headers: ``(name, value)`` pairs, lower-case names, latin-1 bytes (ASGI's form).
        body: the whole request body (already within ``--max-body-bytes``).
        conversation: the request's conversation keys (:func:`~.conversations.conversation_keys`) for the
            router; empty for other requests.
        response_id: the id the response of a Responses request takes (it will be stored), None otherwise.
    """

    method: str
    path: str
    query: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    conversation: tuple[bytes, ...] = field(default=(), repr=False)
    response_id: str | None = None


async def asgi_messages(app, request: ForwardedRequest) -> AsyncIterator[dict]:
    """Run ``request`` through the ASGI application ``app`` and yield the messages it sends
    (``http.response.start``, then ``http.response.body`` until one without ``more_body``).

    The request body is received whole; after it, ``receive`` waits until this generator is closed
    or cancelled, then says ``http.disconnect`` (the client gone), and the generator waits for the
    application to end (it closes a generation between two tokens). Raises what the application
    raised when it sent no complete response.
    """
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": "http",
        "path": request.path,
        "raw_path": request.path.encode(),
        "query_string": request.query,
        "root_path": "",
        "headers": list(request.headers),
        "client": ("ingress", 0),
        "server": ("replica", 0),
    }
    if request.response_id is not None:
        scope[RESPONSE_ID_SCOPE] = request.response_id
    sent: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    body_read = False

    async def receive() -> dict:
        nonlocal body_read
        if not body_read:
            body_read = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    task = asyncio.ensure_future(app(scope, receive, sent.put))
    getter = None
    try:
        while True:
            if sent.empty() and task.done():
                task.result()  # raises what the application raised
                raise RuntimeError(f"{request.method} {request.path}: the application ended without a response")
            getter = asyncio.ensure_future(sent.get())
            await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                continue
            message = getter.result()
            yield message
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                return
    finally:
        gone.set()  # the application sees the client gone and ends its generation itself
        if getter is not None and not getter.done():
            getter.cancel()
        try:
            await asyncio.shield(task)  # a second cancellation (shutdown) cancels the application too
        except asyncio.CancelledError:
            task.cancel()
            raise
        except Exception:  # noqa: BLE001 - the application answered its error (500) and logged it
            pass


class StatsBoard:
    """The replicas' latest reports (Ray Serve deployment of one replica): each replica's health
    (``/health`` of its application), metrics (Prometheus text) and process id, by replica id. A
    report's age is measured here, on the board's clock (the replicas' and the ingress' clocks may
    differ); a replica silent for :data:`FORGET_SECONDS` (gone: a restarted replica has a new id) is
    dropped."""

    def __init__(self):
        self._reports: dict[str, tuple[float, dict]] = {}

    def report(self, replica: str, report: dict) -> None:
        self._reports[replica] = (time.monotonic(), report)

    def reports(self) -> dict[str, dict]:
        """Replica id -> its last report with ``age_s`` (seconds since it came)."""
        now = time.monotonic()
        for replica in [r for r, (at, _) in self._reports.items() if now - at > FORGET_SECONDS]:
            del self._reports[replica]
        return {replica: {**report, "age_s": now - at} for replica, (at, report) in self._reports.items()}


class ChatReplica:
    """A Ray Serve replica serving ``model`` with ``options`` and ``runtime`` (its share of the
    threads); ``board``: the :class:`StatsBoard` deployment's handle.

    Raises (at start, so Ray reports the replica as failed to start):
        ContractError / ValueError / OSError: a bad export or options (as ``serve`` does).
    """

    def __init__(self, model: str, options: ServerOptions, runtime: RuntimeOptions, board=None):
        from ray import serve

        share_threads(runtime)
        self.pipeline = Pipeline.from_exported(Path(model), runtime)
        self.app = create_app(self.pipeline, options)
        self.server = self.app.state.server
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.board = board
        self._lifespan = None
        self._started = asyncio.Lock()
        self._stop = threading.Event()
        if board is not None:
            threading.Thread(target=self._report_loop, name="qwen35-report", daemon=True).start()

    async def _start(self) -> None:
        """Enter the application's lifespan (its scheduler takes this event loop) once."""
        async with self._started:
            if self._lifespan is None:
                context = self.app.router.lifespan_context(self.app)
                await context.__aenter__()
                self._lifespan = context

    async def chat(self, request: ForwardedRequest) -> AsyncIterator[tuple]:
        """Answer ``request``: yields ``("start", status, headers)`` then ``("body", bytes)`` parts
        (a streamed reply: one per event)."""
        await self._start()
        async for message in asgi_messages(self.app, request):
            if message["type"] == "http.response.start":
                yield ("start", message["status"], tuple(message.get("headers", ())))
            elif message.get("body"):
                yield ("body", bytes(message["body"]))

    def report(self) -> dict:
        """This replica's health (its application's ``/health`` object), metrics text, process and
        node."""
        content, _ = self.server.metrics.render()
        return {
            "health": self.server.health(),
            "metrics": content.decode() if isinstance(content, bytes) else content,
            "pid": os.getpid(),
            "node": socket.gethostname(),
        }

    def _report_loop(self) -> None:
        while not self._stop.wait(REPORT_SECONDS):
            try:
                self.board.report.remote(self.replica_id, self.report())
            except Exception:  # noqa: BLE001 - the board restarts with the application; report again later
                log.debug("reporting to the board failed", exc_info=True)

    def check_health(self) -> None:
        """Ray Serve's health check: raises when the generation worker can no longer run."""
        executor = self.server.scheduler.executor
        if getattr(executor, "_shutdown", False):
            raise RuntimeError("the replica's generation worker has shut down")

    def __del__(self):
        self._stop.set()
        server = getattr(self, "server", None)
        if server is not None:
            server.scheduler.shutdown()
