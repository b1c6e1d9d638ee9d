"""``qwen35-onnx serve``: an OpenAI-compatible chat server, a thin HTTP layer over the pipeline.

Routes:

- ``POST /v1/chat/completions``: the OpenAI Chat Completions body (``messages``, ``stream``,
  ``max_tokens`` / ``max_completion_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop``,
  ``stream_options.include_usage``, ``n`` = 1) plus two extensions vLLM also takes: ``top_k``
  and ``chat_template_kwargs`` (e.g. ``{"enable_thinking": false}``). Replies carry
  ``reasoning_content`` next to ``content`` (vLLM's field). ``model`` may be any string: one
  model is served and its id is echoed.
- ``GET /v1/models``, ``GET /v1/models/{id}``: the served model.
- ``GET /health`` (no auth): status, running / waiting generations and counters.

How requests run. The graphs of a :class:`~qwen35_onnx.pipeline.Pipeline` are not
thread-safe, so every generation call (start, each step, close) runs in ONE worker thread, in
arrival order. A request's body and fields are checked first (400 at once, whatever the load);
a request that finds the queue full then gets 429 before anything costly; otherwise it is
prepared (``Pipeline.prepare_chat``: messages, images, chat template, prompt length; 400 on
bad input) in a second thread, beside the running generation (preparation runs no graph and
shares the tokenizer under the preprocessor's lock), so decoding a large image does not stall
a stream. Then it asks for the one generation slot: free -> it runs; busy -> it waits in a
FIFO queue of at most ``max_queue`` requests; queue full -> 429. A generation advances in steps, each step one job
of the worker thread (one delta when streaming; up to ``STEP_SECONDS`` of tokens otherwise), so
other requests' checks run between two tokens. It holds the slot until its stream has ended
and been closed in the worker thread. A client that disconnects (while waiting, while its
stream runs, or during a non-streamed generation) is noticed at once: its generation is
closed between two tokens (``ChatStream.close`` in the worker thread) and the slot passes on.

Errors are OpenAI error bodies ``{"error": {"message", "type", "param", "code"}}``: 400 for
malformed JSON, wrong types, bad values, bad messages or images, prompts over the capacity;
401 for a missing or wrong API key; 413 for a body over ``max_body_bytes`` or an image over
``max_image_bytes``; 429 for a full queue; 500 (``server_error``, logged) only when a
generation itself fails. Layering: this module imports the pipeline, never the reverse.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import math
import numbers
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from .pipeline import ChatDelta, ChatInputError, ChatStream, ImagePolicy, Pipeline, PreparedPrompt
from .runtime.chat import ImageTooLarge
from .runtime.preprocess import TemplateKwargsError
from .runtime.sampling import SamplingConfig, sampling_defaults

log = logging.getLogger(__name__)

__all__ = ["APIError", "ChatRequest", "ServerOptions", "create_app", "parse_chat_request"]

MIB = 1024 * 1024
DEFAULT_MAX_BODY_BYTES = 32 * MIB
DEFAULT_MAX_IMAGE_BYTES = 20 * MIB
DEFAULT_MAX_IMAGE_PIXELS = 50_000_000
DEFAULT_MAX_QUEUE = 8
MAX_STOP_STRINGS = 16
STEP_SECONDS = 0.05
"""A non-streamed generation's step: tokens for up to this long per worker-thread job."""

API_KEY_ENV = "QWEN35_ONNX_API_KEY"

@dataclass(frozen=True)
class ServerOptions:
    """What ``qwen35-onnx serve`` takes besides the export folder.

    Attributes:
        model_name: the served model id (``/v1/models``, echoed in replies).
        api_key: when set, ``/v1/*`` needs ``Authorization: Bearer <api_key>``.
        max_queue: requests allowed to wait while one generation runs (0: none).
        max_body_bytes: largest request body.
        max_image_bytes: largest encoded image (a data URL's decoded bytes or a file).
        max_image_pixels: largest image (width x height), read from its header before decoding.
        allowed_image_dir: local image paths / file:// URLs are read from inside this folder
            only; None: no local files (data: URLs only).
    """

    model_name: str
    api_key: str | None = None
    max_queue: int = DEFAULT_MAX_QUEUE
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    allowed_image_dir: Path | None = None

    def validate(self) -> None:
        """Raises ValueError naming the option and its allowed range."""
        if not isinstance(self.model_name, str) or not self.model_name.strip():
            raise ValueError(f"--model-name must be a non-empty string, got {self.model_name!r}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("--api-key must not be empty")
        if self.max_queue < 0:
            raise ValueError(f"--max-queue must be >= 0, got {self.max_queue}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"--max-body-bytes must be >= 1024, got {self.max_body_bytes}")
        if self.max_image_bytes < 1:
            raise ValueError(f"--max-image-bytes must be >= 1, got {self.max_image_bytes}")
        if self.max_image_pixels < 1:
            raise ValueError(f"--max-image-pixels must be >= 1, got {self.max_image_pixels}")
        if self.allowed_image_dir is not None and not Path(self.allowed_image_dir).is_dir():
            raise ValueError(f"--allowed-image-dir {str(self.allowed_image_dir)!r} is not a folder")

    @property
    def image_policy(self) -> ImagePolicy:
        local = Path(self.allowed_image_dir).resolve() if self.allowed_image_dir is not None else None
        return ImagePolicy(local_dir=local, allow_any_local=False, max_image_bytes=self.max_image_bytes,
                           max_image_pixels=self.max_image_pixels)


class APIError(Exception):
    """An error answered as an OpenAI error body with HTTP ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def _bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param, "invalid_value" if param else None)


# ---- the request body --------------------------------------------------------------------------
@dataclass
class ChatRequest:
    """A checked ``/v1/chat/completions`` body."""

    messages: list
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop: tuple[str, ...] = ()
    chat_template_kwargs: dict | None = None


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def parse_chat_request(body, defaults: SamplingConfig | None = None, reserved_kwargs=frozenset()) -> ChatRequest:
    """Check the types and values of a ``/v1/chat/completions`` body (``messages`` themselves are
    checked by ``Pipeline.prepare_chat``). ``defaults``: the export's sampling defaults;
    ``reserved_kwargs``: names ``chat_template_kwargs`` may not set
    (``Preprocessor.reserved_template_kwargs``), refused here so the 400 comes before any queueing.

    Raises:
        APIError: 400 naming the field and what it must be.
    """
    defaults = defaults or SamplingConfig()
    if not isinstance(body, dict):
        raise _bad(f"the request body must be a JSON object, got {type(body).__name__}")
    if "messages" not in body:
        raise _bad("messages is required", "messages")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad(f"model must be a string, got {type(model).__name__}", "model")

    def optional(name, check, what):
        value = body.get(name)
        if value is not None and not check(value):
            raise _bad(f"{name} must be {what}, got {json.dumps(value)[:80]}", name)
        return value

    stream = bool(optional("stream", lambda v: isinstance(v, bool), "true or false"))
    stream_options = optional("stream_options", lambda v: isinstance(v, dict), "an object")
    include_usage = False
    if stream_options:
        include_usage = stream_options.get("include_usage")
        if include_usage is not None and not isinstance(include_usage, bool):
            raise _bad("stream_options.include_usage must be true or false", "stream_options.include_usage")
        include_usage = bool(include_usage)

    n = optional("n", _is_int, "an integer")
    if n is not None and n != 1:
        raise _bad(f"n must be 1 (one choice per request), got {n}", "n")
    max_tokens = None
    for name in ("max_tokens", "max_completion_tokens"):  # the newer name wins, as in vLLM
        value = optional(name, lambda v: _is_int(v) and v >= 1, "an integer >= 1")
        if value is not None:
            max_tokens = int(value)

    temperature = optional("temperature", lambda v: _is_number(v) and math.isfinite(v) and v >= 0,
                           "a number >= 0 (0 = greedy)")
    top_p = optional("top_p", lambda v: _is_number(v) and 0 < v <= 1, "a number in (0, 1]")
    top_k = optional("top_k", lambda v: _is_int(v) and v >= -1, "an integer >= -1 (0 or -1 = off)")
    seed = optional("seed", lambda v: _is_int(v) and v >= 0, "an integer >= 0")
    sampling = SamplingConfig(
        temperature=defaults.temperature if temperature is None else float(temperature),
        top_k=defaults.top_k if top_k is None else max(int(top_k), 0),
        top_p=defaults.top_p if top_p is None else float(top_p),
        seed=None if seed is None else int(seed),
    )
    try:
        sampling.validate()
    except ValueError as exc:
        raise _bad(str(exc), str(exc).split(" ", 1)[0]) from None

    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stop = tuple(stop)
    else:
        raise _bad("stop must be a string or a list of strings", "stop")
    if len(stop) > MAX_STOP_STRINGS or any(not s for s in stop):
        raise _bad(f"stop must hold at most {MAX_STOP_STRINGS} non-empty strings", "stop")

    kwargs = optional("chat_template_kwargs", lambda v: isinstance(v, dict), "an object")
    if kwargs:
        reserved = sorted(set(reserved_kwargs) & set(kwargs))
        if reserved:
            raise _bad(f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs")

    # Features this server does not have: refused rather than silently ignored.
    for name, off in (("tools", lambda v: not v), ("functions", lambda v: not v),
                      ("logprobs", lambda v: not v), ("logit_bias", lambda v: not v),
                      ("presence_penalty", lambda v: v == 0), ("frequency_penalty", lambda v: v == 0),
                      ("response_format", lambda v: isinstance(v, dict) and v.get("type") == "text")):
        value = body.get(name)
        if value is not None and not off(value):
            raise _bad(f"{name} is not supported by this server", name)

    return ChatRequest(messages=body["messages"], stream=stream, include_usage=include_usage, max_tokens=max_tokens,
                       sampling=sampling, stop=stop, chat_template_kwargs=kwargs or None)


# ---- the generation slot and its queue ------------------------------------------------------------
class Slots:
    """One generation slot and a FIFO queue of at most ``max_queue`` waiters (event-loop only)."""

    def __init__(self, max_queue: int):
        self.max_queue = max_queue
        self.busy = False
        self._waiters: deque[asyncio.Future] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @property
    def full(self) -> bool:
        """A new request would find the slot taken and no room in the queue."""
        return self.busy and len(self._waiters) >= self.max_queue

    def busy_error(self) -> "APIError":
        return APIError(429, f"the server is busy: one generation is running and {len(self._waiters)} requests "
                             f"are waiting (the limit, --max-queue {self.max_queue}); retry later", code="queue_full")

    def enter(self) -> asyncio.Future | None:
        """Take the slot (None) or a place in the queue (a future set when the slot is handed
        over). Raises APIError 429 when the queue is full."""
        if not self.busy and not self._waiters:
            self.busy = True
            return None
        if self.full:
            raise self.busy_error()
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        return waiter

    def leave_queue(self, waiter: asyncio.Future) -> None:
        """A waiter gives up; a slot already handed to it passes on."""
        if waiter.done() and not waiter.cancelled():
            self.release()
            return
        waiter.cancel()
        try:
            self._waiters.remove(waiter)
        except ValueError:
            pass

    def release(self) -> None:
        """The running generation is over: hand the slot to the first waiter, or free it."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.busy = False


class _Generation:
    """One admitted generation. Its :class:`ChatStream` is touched only by the worker thread
    (``_pull``, ``_end``); the event loop asks for steps and for cancellation."""

    def __init__(self, server: "_Server", stream: ChatStream):
        self.server = server
        self.stream = stream
        self._deltas = iter(stream)
        self.outcome: str | None = None  # completed | cancelled | failed (worker thread writes)
        self._cancel_sent = False

    async def step(self, seconds: float) -> tuple[list[ChatDelta], bool]:
        """The next delta(s) (at least one unless the stream ends) and whether it has ended."""
        return await self.server.call(self._pull, seconds)

    def _pull(self, seconds: float) -> tuple[list[ChatDelta], bool]:  # worker thread
        if self.outcome is not None:
            return [], True
        deltas: list[ChatDelta] = []
        deadline = time.monotonic() + seconds
        try:
            for delta in self._deltas:
                deltas.append(delta)
                if time.monotonic() >= deadline:
                    return deltas, False
        except BaseException:
            self._end("failed")
            raise
        self._end("completed")
        return deltas, True

    def _end(self, outcome: str) -> None:  # worker thread; the first outcome counts
        if self.outcome is not None:
            return
        self.outcome = outcome
        try:
            self.stream.close()
        except Exception:  # noqa: BLE001 - closing must not keep the slot
            log.exception("closing a generation failed")
        finally:
            try:
                self.server.loop.call_soon_threadsafe(self.server.finished, self)
            except RuntimeError:  # the event loop has closed: the server is gone
                pass

    def cancel(self) -> None:
        """Stop the generation between two tokens and free its slot (idempotent, returns at once)."""
        if not self._cancel_sent:
            self._cancel_sent = True
            self.stream.cancel()  # thread-safe: ends a step that is running now, before its next token
            try:
                self.server.executor.submit(self._end, "cancelled")
            except RuntimeError:  # the worker has shut down (server exit): nothing left to free
                pass


class _EventStream(StreamingResponse):
    """``text/event-stream`` response that cancels its generation however the response ends
    (finished, client gone, server shutting down)."""

    def __init__(self, content: AsyncIterator[str], on_exit: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_exit = on_exit

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_exit()


def _sse(payload) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def _delta_dict(delta: ChatDelta) -> dict:
    out = {}
    if delta.reasoning_content:
        out["reasoning_content"] = delta.reasoning_content
    if delta.content:
        out["content"] = delta.content
    return out


async def _until_disconnected(request: Request) -> None:
    """Returns when the client has gone (call after the body has been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Server:
    """The state behind the routes: pipeline, worker thread, slot and queue, counters."""

    def __init__(self, pipeline: Pipeline, options: ServerOptions, defaults: SamplingConfig):
        self.pipeline = pipeline
        self.options = options
        self.defaults = defaults
        self.image_policy = options.image_policy
        self.slots = Slots(options.max_queue)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qwen35-pipeline")
        # request preparation (image decoding, chat template, tokenization) runs beside the
        # generation, so a large image does not stall a running stream; Pipeline.prepare_chat
        # touches no graph and the tokenizer is shared under the preprocessor's lock
        self.prepare_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qwen35-prepare")
        self.loop: asyncio.AbstractEventLoop | None = None
        self.created = int(time.time())
        self.counters = {"completed": 0, "cancelled": 0, "failed": 0, "rejected": 0, "left_queue": 0}
        self.last: dict | None = None

    async def call(self, fn, *args):
        """Run ``fn(*args)`` in the pipeline's worker thread (the only thread that touches it)."""
        return await self.loop.run_in_executor(self.executor, functools.partial(fn, *args))

    def finished(self, generation: _Generation) -> None:  # event loop
        self.counters[generation.outcome] += 1
        result = generation.stream.result
        self.last = {"outcome": generation.outcome, "finish_reason": result.finish_reason,
                     "prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens}
        self.slots.release()

    # ---- request handling ----
    def authorize(self, request: Request) -> None:
        key = self.options.api_key
        if key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "missing or wrong API key: send Authorization: Bearer <key>", code="invalid_api_key")

    async def read_json(self, request: Request):
        limit = self.options.max_body_bytes
        too_large = f"more than the limit of {limit} bytes (--max-body-bytes)"
        length = request.headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                raise _bad(f"Content-Length {length[:40]!r} is not a number")
            if int(length) > limit:
                raise APIError(413, f"the request body is {int(length)} bytes, {too_large}", code="request_too_large")
        body = bytearray()
        try:
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise APIError(413, f"the request body is {too_large}", code="request_too_large")
        except ClientDisconnect:
            raise _bad("the client disconnected before sending the whole body") from None
        if not body:
            raise _bad("the request body is empty; send a JSON object")
        try:
            if len(body) > MIB:
                return await asyncio.to_thread(json.loads, bytes(body))
            return json.loads(bytes(body))
        except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise _bad(f"the request body is not valid JSON: {str(exc)[:200]}") from None

    def prepare(self, req: ChatRequest) -> PreparedPrompt:  # preparation thread
        try:
            return self.pipeline.prepare_chat(req.messages, req.chat_template_kwargs, self.image_policy)
        except ImageTooLarge as exc:
            raise APIError(413, f"{exc} (--max-image-bytes, --max-image-pixels)", exc.param, "image_too_large") from None
        except ChatInputError as exc:
            raise _bad(str(exc), exc.param) from None
        except ValueError as exc:  # invalid Unicode, template errors, prompt over the capacity
            param = "chat_template_kwargs" if isinstance(exc, TemplateKwargsError) else "messages"
            raise _bad(str(exc), param) from None

    async def chat_completions(self, request: Request) -> Response:
        self.authorize(request)
        req = parse_chat_request(await self.read_json(request), self.defaults,
                                 self.pipeline.preprocessor.reserved_template_kwargs())
        if self.slots.full:  # cheap refusal before the costly preparation
            self.counters["rejected"] += 1
            raise self.slots.busy_error()
        prepared = await self.loop.run_in_executor(self.prepare_executor, self.prepare, req)
        room = self.pipeline.token_room(prepared)
        max_tokens = room if req.max_tokens is None else min(req.max_tokens, room)

        gone = asyncio.ensure_future(_until_disconnected(request))
        try:
            try:
                waiter = self.slots.enter()
            except APIError:
                self.counters["rejected"] += 1
                raise
            if waiter is not None:
                try:
                    await asyncio.wait({waiter, gone}, return_when=asyncio.FIRST_COMPLETED)
                except BaseException:
                    self.slots.leave_queue(waiter)
                    raise
                if not waiter.done():
                    self.slots.leave_queue(waiter)
                    self.counters["left_queue"] += 1
                    return Response(status_code=499)  # nobody is listening
            try:
                stream = await self.call(self.pipeline.stream_chat_prepared, prepared, max_tokens, req.sampling, req.stop)
            except BaseException as exc:
                self.slots.release()
                if isinstance(exc, ValueError):
                    raise _bad(str(exc)) from None
                raise
            generation = _Generation(self, stream)
            completion_id = f"chatcmpl-{uuid.uuid4().hex}"
            if req.stream:
                gone.cancel()  # the streaming response watches the connection itself
                return _EventStream(self._events(generation, req, completion_id), generation.cancel)
            try:
                return await self._whole(generation, gone, completion_id)
            finally:
                generation.cancel()  # no-op once it has ended
        finally:
            gone.cancel()

    def _chunk(self, completion_id: str, created: int, choices: list, usage=None, include_usage=False) -> dict:
        chunk = {"id": completion_id, "object": "chat.completion.chunk", "created": created,
                 "model": self.options.model_name, "system_fingerprint": None, "choices": choices}
        if include_usage:
            chunk["usage"] = usage
        return chunk

    @staticmethod
    def _usage(result) -> dict:
        return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
                "total_tokens": result.prompt_tokens + result.completion_tokens}

    async def _events(self, generation: _Generation, req: ChatRequest, completion_id: str) -> AsyncIterator[str]:
        created = int(time.time())
        usage_on = req.include_usage

        def choice(delta: dict, finish=None) -> list:
            return [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]

        yield _sse(self._chunk(completion_id, created, choice({"role": "assistant", "content": ""}),
                               include_usage=usage_on))
        ended = False
        while not ended:
            try:
                deltas, ended = await generation.step(0.0)
            except Exception as exc:  # noqa: BLE001 - a failed generation ends the stream cleanly
                log.exception("generation %s failed", completion_id)
                yield _sse(APIError(500, f"the generation failed: {exc}", type="server_error",
                                    code="generation_failed").body())
                yield "data: [DONE]\n\n"
                return
            for delta in deltas:
                if delta:
                    yield _sse(self._chunk(completion_id, created, choice(_delta_dict(delta)), include_usage=usage_on))
        result = generation.stream.result
        yield _sse(self._chunk(completion_id, created, choice({}, result.finish_reason), include_usage=usage_on))
        if usage_on:
            yield _sse(self._chunk(completion_id, created, [], self._usage(result), include_usage=True))
        yield "data: [DONE]\n\n"

    async def _whole(self, generation: _Generation, gone: asyncio.Future, completion_id: str) -> Response:
        ended = False
        while not ended:
            if gone.done():
                return Response(status_code=499)  # the caller cancels the generation
            try:
                _, ended = await generation.step(STEP_SECONDS)
            except Exception as exc:  # noqa: BLE001
                log.exception("generation %s failed", completion_id)
                raise APIError(500, f"the generation failed: {exc}", type="server_error",
                               code="generation_failed") from None
        result = generation.stream.result
        message = {"role": "assistant", "content": result.content, "reasoning_content": result.reasoning_content}
        return JSONResponse({
            "id": completion_id, "object": "chat.completion", "created": int(time.time()),
            "model": self.options.model_name, "system_fingerprint": None,
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": result.finish_reason}],
            "usage": self._usage(result),
        })

    def model_card(self) -> dict:
        return {"id": self.options.model_name, "object": "model", "created": self.created, "owned_by": "qwen35-onnx",
                "max_model_len": self.pipeline.contract.capacity}

    def health(self) -> dict:
        return {"status": "ok", "model": self.options.model_name, "running": int(self.slots.busy),
                "waiting": self.slots.waiting, "max_queue": self.options.max_queue, **self.counters,
                "last": self.last}


def create_app(pipeline: Pipeline, options: ServerOptions, defaults: SamplingConfig | None = None) -> FastAPI:
    """The FastAPI application serving ``pipeline`` (see the module docstring).

    Args:
        pipeline: a loaded export; the application becomes its only user.
        options: limits, auth and names.
        defaults: sampling when a request sets none (default: :func:`sampling_defaults` of the export).
    """
    options.validate()
    if defaults is None:
        defaults = sampling_defaults(pipeline.root)
    server = _Server(pipeline, options, defaults)

    @asynccontextmanager
    async def lifespan(app):
        server.loop = asyncio.get_running_loop()
        try:
            yield
        finally:
            server.executor.shutdown(wait=False, cancel_futures=True)
            server.prepare_executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="qwen35-onnx", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return _bad(first.get("msg", "invalid request"), param).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=code).response()

    @app.exception_handler(Exception)
    async def server_bug(request: Request, exc: Exception):
        log.error("unexpected error in %s %s", request.method, request.url.path, exc_info=exc)
        return APIError(500, "internal server error (logged)", type="server_error", code="internal_error").response()

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
            raise APIError(404, f"model {model_id!r} is not served here; this server serves {options.model_name!r}",
                           "model", "model_not_found")
        return server.model_card()

    @app.get("/health")
    async def health():
        return server.health()

    return app



def serve(model: str | Path, options: ServerOptions, host: str = "127.0.0.1", port: int = 8000, threads: int = 0,
          announce: Callable[[str], None] = print) -> None:
    """Load the export, bind ``host:port`` (port 0: a free port), call ``announce`` with the
    listening URL, and serve until interrupted.

    Raises:
        ContractError / ValueError / OSError: a bad export, bad options, an address in use.
    """
    import socket

    import uvicorn

    options.validate()
    pipeline = Pipeline.from_exported(model, threads=threads)
    app = create_app(pipeline, options)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(128)
    bound_port = sock.getsockname()[1]
    shown = f"[{host}]" if family == socket.AF_INET6 else host
    config = uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=5, access_log=True)
    server = uvicorn.Server(config)
    announce(f"serving {options.model_name} on http://{shown}:{bound_port}/v1 (capacity "
             f"{pipeline.contract.capacity}, queue {options.max_queue}{', API key required' if options.api_key else ''})")
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
