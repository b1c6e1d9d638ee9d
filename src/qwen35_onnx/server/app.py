"""``qwen35-onnx serve``: the HTTP application, thin routes over the conversation core (:mod:`.core`) and one
module per API that parses its bodies and writes its replies.

Routes:

- ``POST /v1/chat/completions``: OpenAI Chat Completions (:mod:`.chat_completions`).
- ``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}``, ``POST /v1/responses/input_tokens``: the OpenAI
  Responses API (:mod:`.responses`).
- ``POST /v1/messages``, ``POST /v1/messages/count_tokens``: the Anthropic Messages API (:mod:`.messages`).
- ``GET /v1/models``, ``GET /v1/models/{id}``: the served model (``model`` in a request may be any string: one
  model is served and its id is echoed).
- ``GET /health`` (no auth): status, capacity, ``--max-tokens``, running / waiting generations and counters.
- ``GET /metrics``: Prometheus metrics (:mod:`.metrics`; the API key when one is set).
- ``GET /``: a chat page (``page.html``, self-contained: nothing loaded from elsewhere) that talks to
  ``/v1/chat/completions``: streaming, images by file picker or drag and drop, reasoning apart, a stop button,
  the tokens the capacity has left.

Errors are each API's error objects (:mod:`.errors`): OpenAI's ``{"error": {"message", "type", "param",
"code"}}`` on the OpenAI routes, Anthropic's ``{"type": "error", "error": {"type", "message"}}`` on
``/v1/messages``: 400 for malformed JSON, wrong types, bad values, bad messages, images or videos, prompts over
the capacity; 401 for a missing or wrong API key; 404 for an unknown stored response; 413 for a body over
``max_body_bytes``, an image over ``max_image_bytes`` / ``max_image_pixels`` or a video over ``max_video_bytes`` /
``max_video_seconds`` / ``max_video_frame_pixels``; 422 (``reply_format_failed``, naming the tools or the answer's
format, null when the grammar held both; the grammar engine's report in the log only) when the grammar that
enforces a reply fails mid-reply; 429 for a full queue; 500 (``server_error``, logged) when a generation fails
otherwise. A streamed reply has begun with 200: its failure is the API's error event.
Layering: this package imports the pipeline, never the reverse.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
from collections.abc import Callable
from contextlib import asynccontextmanager
from importlib import resources
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, Response

from ..pipeline import Pipeline
from ..runtime.backend import RuntimeOptions
from ..runtime.sampling import SamplingConfig
from ..runtime.select import share_threads
from ..streams import ChatResult
from .chat_completions import ChatCompletions
from .core import ConversationCore
from .errors import APIError
from .http import JSONBody, install_error_handlers
from .messages import Messages
from .options import ServerOptions
from .response_store import ResponseStore
from .responses import Responses

__all__ = ["base_url", "bound_socket", "create_app", "serve"]


def _reasoning_tokens(pipeline: Pipeline):
    """A function: the reasoning tokens of a finished reply (up to its ``</think>``; all of a reply whose reasoning
    was cut off; 0 without reasoning)."""
    think_end = pipeline.think_end_id if pipeline.has_think_markers else None

    def count(result: ChatResult) -> int:
        if result.reasoning_content is None or think_end is None:
            return 0
        tokens = result.generation.token_ids
        return tokens.index(think_end) if think_end in tokens else len(tokens)

    return count


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
    core = ConversationCore(pipeline, options, defaults)
    model, reserved = options.model_name, core.reserved_kwargs
    chat = ChatCompletions(model, defaults, reserved)
    store = ResponseStore(options.response_store_bytes)
    responses = Responses(model, defaults, store, _reasoning_tokens(pipeline), reserved)
    messages = Messages(model, defaults)

    @asynccontextmanager
    async def lifespan(app):
        core.scheduler.loop = asyncio.get_running_loop()
        try:
            yield
        finally:
            core.scheduler.shutdown()
            if core.state_cache is not None:
                await asyncio.to_thread(core.state_cache.close)  # the states waiting to be written

    app = FastAPI(title="qwen35-onnx", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = core
    install_error_handlers(app)

    async def read(request: Request, route: str, answer):
        """Answer a request that generates nothing (``answer(body) -> dict``), counted under ``route``."""

        async def run():
            core.authorize(request)
            return JSONBody(await answer(await core.read_json(request)))

        return await core.counted(route, run)

    async def stored(request: Request, answer):
        async def run():
            core.authorize(request)
            return JSONBody(answer())

        return await core.counted("/v1/responses/{id}", run)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await core.answer(request, chat)

    @app.post("/v1/responses")
    async def create_response(request: Request):
        return await core.answer(request, responses)

    @app.post("/v1/responses/input_tokens")
    async def response_input_tokens(request: Request):
        async def count(body):
            return responses.input_tokens_body(await core.count_tokens(responses.parse(body).chat))

        return await read(request, "/v1/responses/input_tokens", count)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request):
        return await stored(request, lambda: responses.stored(response_id))

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request):
        return await stored(request, lambda: responses.delete(response_id))

    @app.post("/v1/messages")
    async def create_message(request: Request):
        return await core.answer(request, messages)

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(request: Request):
        async def count(body):
            return messages.count_body(await core.count_tokens(messages.parse_count(body).chat))

        return await read(request, messages.count_route, count)

    @app.get("/v1/models")
    async def models(request: Request):
        core.authorize(request)
        return {"object": "list", "data": [core.model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model_card(model_id: str, request: Request):
        core.authorize(request)
        if model_id != options.model_name:
            raise APIError(
                404,
                f"model {model_id!r} is not served here; this server serves {options.model_name!r}",
                "model",
                "model_not_found",
            )
        return core.model_card()

    @app.get("/health")
    async def health():
        return {**core.health(), "response_store": store.stats()}

    page = resources.files(__package__).joinpath("page.html").read_text(encoding="utf-8")

    @app.api_route("/", methods=["GET", "HEAD"])
    async def chat_page():
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    @app.get("/metrics")
    async def metrics(request: Request):
        core.authorize(request)
        content, media_type = core.metrics.render()
        return Response(content, media_type=media_type)

    return app


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
    cap = f", replies of at most {options.max_tokens} tokens" if options.max_tokens else ""
    announce(
        f"serving {options.model_name} on {base_url(host, bound_port)}/v1 ({backend.runtime} {backend.device}, "
        f"capacity {pipeline.contract.capacity}{cap}, queue {options.max_queue}"
        f"{', API key required' if options.api_key else ''})"
    )
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
