"""``qwen35-onnx serve``: the OpenAI-compatible HTTP application, a thin layer over the pipeline
(the protocol in :mod:`.protocol`, the slots, queue and worker thread in :mod:`.scheduler`).

Routes:

- ``POST /v1/chat/completions``: see :mod:`.protocol` for the fields. ``model`` may be any
  string: one model is served and its id is echoed.
- ``GET /v1/models``, ``GET /v1/models/{id}``: the served model.
- ``GET /health`` (no auth): status, running / waiting generations and counters.
- ``GET /metrics``: Prometheus metrics (:mod:`.metrics`; the API key when one is set).
- ``GET /``: a chat page (``page.html``, self-contained: nothing loaded from elsewhere) that talks
  to ``/v1/chat/completions``: streaming, images by file picker or drag and drop, reasoning
  apart, a stop button.

How a request runs: its body and fields are checked first (400 at once, whatever the load); a
request that finds the queue full then gets 429 before anything costly; otherwise it is prepared
(``Pipeline.prepare_chat``: messages, images, chat template, prompt length; 400 on bad input)
beside the running generations, then takes one of the export's decode slots or waits for one
(:mod:`.scheduler`: continuous batching, every running generation advances by a token per decode
step). A streamed generation sends its deltas as its tokens come; a whole one is read every
``STEP_SECONDS`` at most. A client that disconnects (while waiting, while its stream runs, or during
a non-streamed generation) is noticed at once: its generation is closed between two tokens and
its slot passes on.

Errors are OpenAI error bodies ``{"error": {"message", "type", "param", "code"}}``: 400 for
malformed JSON, wrong types, bad values, bad messages, images or videos, prompts over the capacity;
401 for a missing or wrong API key; 413 for a body over ``max_body_bytes``, an image over
``max_image_bytes`` / ``max_image_pixels`` or a video over ``max_video_bytes`` / ``max_video_seconds`` /
``max_video_frame_pixels``; 422 (``reply_format_failed``, naming ``tools`` or
``response_format``, null when the grammar held both; the grammar engine's report in the log only)
when the grammar that enforces a reply fails mid-reply; 429 for a full queue; 500 (``server_error``,
logged) when a generation fails otherwise. A streamed reply has begun with 200: its failure is an
error event with the same body, then ``[DONE]``.
Layering: this package imports the pipeline, never the reverse.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from importlib import resources
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..conversation.grammar import GrammarError
from ..conversation.messages import ChatInputError, ImageTooLarge
from ..conversation.processor import TemplateKwargsError
from ..pipeline import Pipeline
from ..runtime.backend import RuntimeOptions
from ..runtime.prompt import PreparedPrompt
from ..runtime.sampling import SamplingConfig
from ..runtime.select import share_threads
from ..runtime.snapshot_disk import StateCacheFolderError
from ..runtime.snapshots import SnapshotCache
from .metrics import ServerMetrics
from .options import MIB, ServerOptions
from .protocol import (
    SSE_DONE,
    APIError,
    ChatRequest,
    bad_request,
    chunk,
    chunk_choice,
    completion,
    delta_dict,
    message_dict,
    parse_chat_request,
    sse,
    usage,
)
from .scheduler import ScheduledGeneration, Scheduler

log = logging.getLogger(__name__)

__all__ = ["authorize", "base_url", "bound_socket", "create_app", "install_error_handlers", "read_body", "serve"]

STEP_SECONDS = 0.05
"""A non-streamed generation's step: tokens for up to this long per worker-thread job."""


class _EventStream(StreamingResponse):
    """``text/event-stream`` response that cancels its generation however the response ends
    (finished, client gone, server shutting down)."""

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


def _error_response(error: APIError) -> JSONResponse:
    headers = None if error.retry_after is None else {"Retry-After": str(error.retry_after)}
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def _generation_error(exc: Exception, req: ChatRequest, completion_id: str) -> APIError:
    """The error that ends a generation which raised ``exc`` (logged here, with the grammar engine's
    report for a :class:`GrammarError`): 422 ``reply_format_failed`` when the grammar engine failed
    (a short message, nothing of the engine's state; ``param`` ``tools`` or ``response_format``, none
    when the grammar held both), else 500 ``generation_failed``."""
    if isinstance(exc, GrammarError):
        log.error("generation %s: %s; the grammar engine reports:\n%s", completion_id, exc, exc.details)
        fields = req.reply.constrained_fields
        return APIError(
            422,
            f"the reply could not be kept to the requested {' or '.join(fields)}: {exc} (details in the server "
            "log); the request may be retried",
            fields[0] if len(fields) == 1 else None,
            "reply_format_failed",
        )
    log.exception("generation %s failed", completion_id, exc_info=exc)
    return APIError(500, f"the generation failed: {exc}", type="server_error", code="generation_failed")


async def _until_disconnected(request: Request) -> None:
    """Returns when the client has gone (call after the body has been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def authorize(request: Request, key: str | None) -> None:
    """Raises APIError 401 ``invalid_api_key`` unless ``request`` carries ``Authorization: Bearer
    <key>`` (compared in constant time); nothing when ``key`` is None."""
    if key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(401, "missing or wrong API key: send Authorization: Bearer <key>", code="invalid_api_key")


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


class ChatServer:
    """The state behind the routes: the pipeline, its scheduler, the options and sampling defaults."""

    def __init__(self, pipeline: Pipeline, options: ServerOptions, defaults: SamplingConfig):
        self.pipeline = pipeline
        self.options = options
        self.defaults = defaults
        self.image_policy = options.image_policy
        self.reserved_kwargs = pipeline.preprocessor.reserved_template_kwargs()
        self.scheduler = Scheduler(pipeline, options.max_queue, on_finished=self._record, on_step=self._step)
        self.state_cache = self._state_cache(pipeline, options)
        self.metrics = ServerMetrics(
            self.scheduler.state, self.state_cache.stats if self.state_cache is not None else None
        )
        self.created = int(time.time())

    @staticmethod
    def _state_cache(pipeline: Pipeline, options: ServerOptions) -> SnapshotCache | None:
        """The kept states of ``options`` (None: off, or an export without prefill chunks and no folder asked for).

        Raises:
            ValueError: naming the option: a limit below one snapshot; a folder that is a file or cannot be written
                in, or asked for on an export without prefill chunks.
        """
        folder = options.state_cache_dir
        if not pipeline.contract.prefill_chunks:
            if folder is not None:
                raise ValueError(
                    f"--state-cache-dir {str(folder)!r}: the export has no prefill chunks, so no request can continue "
                    "from a kept state (re-export with --prefill-chunks)"
                )
            return None
        if options.state_cache_bytes == 0:
            return None
        try:
            pipeline.state_cache(options.state_cache_bytes)  # (the memory limit's check)
        except ValueError as exc:
            raise ValueError(f"--state-cache-bytes: {exc}") from None
        try:
            return pipeline.state_cache(options.state_cache_bytes, folder, options.state_cache_disk_bytes)
        except StateCacheFolderError as exc:
            raise ValueError(f"--state-cache-dir: {exc}") from None
        except ValueError as exc:
            raise ValueError(f"--state-cache-disk-bytes: {exc}") from None

    def _step(self, rows: int) -> None:  # worker thread, once per decode step
        self.metrics.decode_step(rows)

    def _record(self, generation: ScheduledGeneration) -> None:  # event loop, once per generation
        result = generation.stream.result
        start = generation.arrived
        timings = result.generation.timings
        self.metrics.generation(
            generation.outcome,
            result.prompt_tokens,
            result.completion_tokens,
            timings.tokens_per_s,
            None if generation.first_text_at is None else generation.first_text_at - start,
            (generation.ended_at or time.monotonic()) - start,
            timings.drafted,
            timings.accepted,
        )

    def authorize(self, request: Request) -> None:
        authorize(request, self.options.api_key)

    async def read_json(self, request: Request):
        body = await read_body(request, self.options.max_body_bytes)
        if not body:
            raise bad_request("the request body is empty; send a JSON object")
        try:
            if len(body) > MIB:
                return await asyncio.to_thread(json.loads, body)
            return json.loads(body)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise bad_request(f"the request body is not valid JSON: {str(exc)[:200]}") from None

    def prepare(self, req: ChatRequest) -> PreparedPrompt:  # preparation thread
        try:
            self.pipeline.grammars.check(req.reply)
            return self.pipeline.prepare_chat(
                req.messages,
                req.chat_template_kwargs,
                self.image_policy,
                req.reply,
                fps=req.fps,
                max_video_tokens=req.max_video_tokens,
            )
        except ImageTooLarge as exc:
            video = ".video" in (exc.param or "")
            limits = (
                "--max-video-bytes, --max-video-seconds, --max-video-frames, --max-video-frame-pixels"
                if video
                else "--max-image-bytes, --max-image-pixels"
            )
            raise APIError(
                413, f"{exc} ({limits})", exc.param, "video_too_large" if video else "image_too_large"
            ) from None
        except ChatInputError as exc:
            raise bad_request(str(exc), exc.param) from None
        except ValueError as exc:  # invalid Unicode, template errors, prompt over the capacity
            param = "chat_template_kwargs" if isinstance(exc, TemplateKwargsError) else "messages"
            raise bad_request(str(exc), param) from None

    async def chat_completions(self, request: Request) -> Response:
        """Answer one request and count it by HTTP status (:attr:`metrics`)."""
        try:
            response = await self._chat_completions(request, time.monotonic())
        except APIError as exc:
            self.metrics.request(exc.status)
            raise
        except Exception:  # answered 500 by the application's handler (a shutdown's cancellation is not counted)
            self.metrics.request(500)
            raise
        self.metrics.request(response.status_code)
        return response

    async def _chat_completions(self, request: Request, arrived: float) -> Response:
        self.authorize(request)
        req = parse_chat_request(await self.read_json(request), self.defaults, self.reserved_kwargs)
        scheduler = self.scheduler
        scheduler.refuse_if_full()  # cheap refusal before the costly preparation
        prepared = await scheduler.prepare(self.prepare, req)
        room = self.pipeline.token_room(prepared)
        max_tokens = room if req.max_tokens is None else min(req.max_tokens, room)

        gone = asyncio.ensure_future(_until_disconnected(request))
        try:
            if not await scheduler.admit(gone):
                return Response(status_code=499)  # nobody is listening
            try:
                generation = await scheduler.start(
                    self.pipeline.stream_chat_prepared,
                    prepared,
                    max_tokens,
                    req.sampling,
                    req.stop,
                    req.reply,
                    self.state_cache,
                    arrived=arrived,
                )
            except ValueError as exc:
                raise bad_request(str(exc)) from None
            completion_id = f"chatcmpl-{uuid.uuid4().hex}"
            if req.stream:
                gone.cancel()  # the streaming response watches the connection itself
                return _EventStream(self._events(generation, req, completion_id), generation.cancel)
            try:
                return await self._whole(generation, gone, req, completion_id)
            finally:
                generation.cancel()  # no-op once it has ended
        finally:
            gone.cancel()

    async def _events(
        self, generation: ScheduledGeneration, req: ChatRequest, completion_id: str
    ) -> AsyncIterator[str]:
        created, model, usage_on = int(time.time()), self.options.model_name, req.include_usage
        yield sse(
            chunk(
                completion_id,
                created,
                model,
                chunk_choice({"role": "assistant", "content": ""}),
                include_usage=usage_on,
            )
        )
        ended, calls = False, 0
        while not ended:
            try:
                deltas, ended = await generation.step(0.0)
            except Exception as exc:  # noqa: BLE001 - a failed generation ends the stream cleanly
                yield sse(_generation_error(exc, req, completion_id).body())
                yield SSE_DONE
                return
            for delta in deltas:
                if delta:
                    body = delta_dict(delta, calls)
                    calls += len(delta.tool_calls)
                    yield sse(chunk(completion_id, created, model, chunk_choice(body), include_usage=usage_on))
        result = generation.stream.result
        yield sse(chunk(completion_id, created, model, chunk_choice({}, result.finish_reason), include_usage=usage_on))
        if usage_on:
            yield sse(
                chunk(
                    completion_id,
                    created,
                    model,
                    [],
                    usage_of(result),
                    include_usage=True,
                )
            )
        yield SSE_DONE

    async def _whole(
        self, generation: ScheduledGeneration, gone: asyncio.Future, req: ChatRequest, completion_id: str
    ) -> Response:
        ended = False
        while not ended:
            if gone.done():
                return Response(status_code=499)  # the caller cancels the generation
            try:
                _, ended = await generation.step(STEP_SECONDS)
            except Exception as exc:  # noqa: BLE001
                raise _generation_error(exc, req, completion_id) from None
        result = generation.stream.result
        message = message_dict(result.content, result.reasoning_content, result.tool_calls)
        return JSONResponse(
            completion(
                completion_id,
                int(time.time()),
                self.options.model_name,
                message,
                result.finish_reason,
                usage_of(result),
            )
        )

    def model_card(self) -> dict:
        return {
            "id": self.options.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "qwen35-onnx",
            "max_model_len": self.pipeline.contract.capacity,
        }

    def health(self) -> dict:
        cache = self.state_cache.stats() if self.state_cache is not None else None
        return {"status": "ok", "model": self.options.model_name, **self.scheduler.state(), "state_cache": cache}


def usage_of(result) -> dict:
    """The ``usage`` object of a finished :class:`~qwen35_onnx.streams.ChatResult`."""
    timings = result.generation.timings
    return usage(
        result.prompt_tokens,
        result.completion_tokens,
        result.generation.cached_tokens,
        timings.drafted,
        timings.accepted,
    )


def install_error_handlers(app: FastAPI) -> None:
    """Answer ``app``'s errors as OpenAI error bodies: :class:`APIError` as raised, FastAPI's
    validation errors as 400, Starlette's HTTP errors (404, 405) with their status, anything else as
    a logged 500 ``internal_error``."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return _error_response(bad_request(first.get("msg", "invalid request"), param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return _error_response(
            APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=code)
        )

    @app.exception_handler(Exception)
    async def server_bug(request: Request, exc: Exception):
        log.error("unexpected error in %s %s", request.method, request.url.path, exc_info=exc)
        return _error_response(
            APIError(500, "internal server error (logged)", type="server_error", code="internal_error")
        )


def bound_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (0: a free port; IPv6 where ``host`` has a colon),
    ``SO_REUSEADDR`` set, not yet listening.

    Raises:
        OSError: the address cannot be bound, naming it.
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def base_url(host: str, port: int) -> str:
    """``http://host:port`` (an IPv6 host in brackets)."""
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def create_app(pipeline: Pipeline, options: ServerOptions, defaults: SamplingConfig | None = None) -> FastAPI:
    """The FastAPI application serving ``pipeline`` (see the module docstring).

    Args:
        pipeline: a loaded export; the application becomes its only user.
        options: limits, auth and names.
        defaults: sampling when a request sets none (default: the pipeline's ``sampling_defaults``,
            from the export's ``generation_config.json``).

    Raises:
        ValueError: bad ``options`` (see :meth:`ServerOptions.validate`).
    """
    options.validate()
    if defaults is None:
        defaults = pipeline.sampling_defaults
    server = ChatServer(pipeline, options, defaults)

    @asynccontextmanager
    async def lifespan(app):
        server.scheduler.loop = asyncio.get_running_loop()
        try:
            yield
        finally:
            server.scheduler.shutdown()
            if server.state_cache is not None:
                await asyncio.to_thread(server.state_cache.close)  # the states waiting to be written

    app = FastAPI(title="qwen35-onnx", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server

    install_error_handlers(app)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await server.chat_completions(request)

    @app.get("/v1/models")
    async def models(request: Request):
        server.authorize(request)
        return {"object": "list", "data": [server.model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        server.authorize(request)
        if model_id != options.model_name:
            raise APIError(
                404,
                f"model {model_id!r} is not served here; this server serves {options.model_name!r}",
                "model",
                "model_not_found",
            )
        return server.model_card()

    @app.get("/health")
    async def health():
        return server.health()

    page = resources.files(__package__).joinpath("page.html").read_text(encoding="utf-8")

    @app.get("/")
    async def chat_page():
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    @app.get("/metrics")
    async def metrics(request: Request):
        server.authorize(request)
        content, media_type = server.metrics.render()
        return Response(content, media_type=media_type)

    return app


def serve(
    model: str | Path,
    options: ServerOptions,
    runtime: RuntimeOptions | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    announce: Callable[[str], None] = print,
) -> None:
    """Load the export with ``runtime`` (default: ONNX Runtime on the CPU), bind ``host:port``
    (port 0: a free port), call ``announce`` with the listening URL, and serve until interrupted.
    ``options.model_name`` None serves the export under its folder's name.

    Raises:
        ContractError / ValueError / OSError: a bad export, bad options, an address in use.
    """
    import dataclasses

    import uvicorn

    if options.model_name is None:
        options = dataclasses.replace(options, model_name=Path(model).resolve().name)
    options.validate()
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {port}")
    share_threads(runtime)  # the process is the server's: its graphs on one thread pool (prefill between steps)
    pipeline = Pipeline.from_exported(model, runtime)
    app = create_app(pipeline, options)
    sock = bound_socket(host, port)
    sock.listen(128)
    bound_port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=5, access_log=True)
    server = uvicorn.Server(config)
    backend = pipeline.backend
    announce(
        f"serving {options.model_name} on {base_url(host, bound_port)}/v1 ({backend.runtime} {backend.device}, "
        f"capacity {pipeline.contract.capacity}, queue {options.max_queue}"
        f"{', API key required' if options.api_key else ''})"
    )
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
