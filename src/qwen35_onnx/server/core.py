"""The conversation core of ``serve``: one path from a :class:`~.request.ChatRequest` to a reply for every API
(chat completions, Responses, Anthropic Messages; each a module of this package that parses its body into the
request and writes the core's deltas in its own shape).

How a request runs (:meth:`ConversationCore.answer`): the API key; the body within ``--max-body-bytes``; the
API's parser (400 at once, whatever the load); a 429 when every slot is taken and the queue is full, before
anything costly; the preparation (``Pipeline.prepare_chat``: messages, images, chat template, grammar, prompt
length; 400 on bad input) in the preparation thread beside the running generations; then one of the export's
decode slots, or a place in the queue (:mod:`.scheduler`: continuous batching). The reply's token limit is the
smallest of the request's, the server's ``--max-tokens`` and what the capacity leaves: a larger request is served
up to it and ends with the length reason (``finish_reason: "length"``). A streamed reply (:meth:`Turn.deltas`)
goes out as its tokens come; a whole one (:meth:`Turn.whole`) is read every :data:`STEP_SECONDS` at most. A
client that disconnects (while waiting, while its stream runs, or during a whole reply) is noticed at once: its
generation is closed between two tokens and its slot passes on.

Counted per route (:mod:`.metrics`): each answered request by status, each generation by how it ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Protocol

from fastapi import Request
from fastapi.responses import Response

from ..contract import PromptTooLongError
from ..conversation.grammar import GrammarError
from ..conversation.messages import ChatInputError, ImageTooLarge
from ..conversation.processor import TemplateKwargsError
from ..conversation.reasoning import ChatDelta
from ..pipeline import Pipeline
from ..runtime.prompt import PreparedPrompt
from ..runtime.sampling import SamplingConfig
from ..runtime.snapshot_disk import StateCacheFolderError
from ..runtime.snapshots import SnapshotCache
from ..streams import ChatResult
from .errors import APIError, bad_request
from .http import EventStream, JSONBody, authorize, read_body
from .metrics import ServerMetrics
from .options import MIB, ServerOptions
from .request import ChatRequest
from .scheduler import ScheduledGeneration, Scheduler

log = logging.getLogger(__name__)

__all__ = ["API", "KEEPALIVE_SECONDS", "STEP_SECONDS", "ConversationCore", "Turn"]

STEP_SECONDS = 0.05
"""A whole reply's step: tokens for up to this long per worker-thread job."""
KEEPALIVE_SECONDS = 15.0
"""A stream that has sent nothing for this long (a long prefill) gets its API's keep-alive (a ping)."""


class API(Protocol):
    """What an API module offers the core: its route (the metrics' label), a parser and two writers."""

    route: str

    def parse(self, body, request: Request | None = None) -> object:
        """The API's request (with a ``chat`` :class:`~.request.ChatRequest`) from a JSON body (and the HTTP
        request it came with); raises APIError."""

    def events(self, turn: Turn, request) -> AsyncIterator[str]:
        """The server-sent events of a streamed reply."""

    def body(self, turn: Turn, deltas: list[ChatDelta], request) -> dict:
        """The whole reply's JSON body."""


class Turn:
    """One admitted request's generation, read on the event loop.

    Attributes:
        id: 32 hex digits, unique (each API prefixes it: ``chatcmpl-``, ``resp_``, ``msg_``).
        created: Unix seconds when the generation started.
        prompt_tokens: the prompt's tokens.
        max_tokens: the reply's token limit (see the module docstring).
        request: the core's request.
    """

    def __init__(
        self,
        generation: ScheduledGeneration,
        request: ChatRequest,
        prompt_tokens: int,
        max_tokens: int,
        gone: asyncio.Future | None = None,
    ):
        """``gone``: done when the client has left (watched by :meth:`whole`; a stream watches its connection
        itself: :meth:`streamed`)."""
        self.generation, self.request = generation, request
        self.prompt_tokens, self.max_tokens = prompt_tokens, max_tokens
        self.id = uuid.uuid4().hex
        self.created = int(time.time())
        self._gone = gone

    def streamed(self) -> None:
        """The reply goes out as a stream, whose response notices a client that leaves: stop watching here."""
        if self._gone is not None:
            self._gone.cancel()

    @property
    def result(self) -> ChatResult:
        """The reply so far (whole once the generation has ended): content, reasoning, calls, finish reason,
        tokens."""
        return self.generation.stream.result

    async def deltas(self, keepalive: float | None = KEEPALIVE_SECONDS) -> AsyncIterator[ChatDelta | None]:
        """The reply's non-empty deltas as they come; None when nothing came for ``keepalive`` seconds (write the
        API's keep-alive).

        Raises:
            APIError: how the generation failed (after the deltas before the failure).
        """
        while True:
            try:
                deltas, ended = await self.generation.step(keepalive or 0.0)
            except Exception as exc:  # noqa: BLE001 - the generation failed: its API error
                raise generation_error(exc, self.request, self.id) from None
            if not deltas and not ended:
                yield None
            for delta in deltas:
                if delta:
                    yield delta
            if ended:
                return

    async def whole(self) -> list[ChatDelta] | None:
        """The whole reply's non-empty deltas; None when the client left first (the caller answers 499).

        Raises:
            APIError: how the generation failed.
        """
        out, ended = [], False
        while not ended:
            if self._gone is not None and self._gone.done():
                return None
            try:
                deltas, ended = await self.generation.step(STEP_SECONDS)
            except Exception as exc:  # noqa: BLE001
                raise generation_error(exc, self.request, self.id) from None
            out.extend(d for d in deltas if d)
        return out

    def cancel(self) -> None:
        """Stop the generation before its next token and free its slot (idempotent)."""
        self.generation.cancel()
        if self._gone is not None:
            self._gone.cancel()


def generation_error(exc: Exception, req: ChatRequest, turn_id: str) -> APIError:
    """The error that ends a generation which raised ``exc`` (logged here, with the grammar engine's report for a
    :class:`GrammarError`): 422 ``reply_format_failed`` when the grammar engine failed (a short message, nothing
    of the engine's state; ``param`` the API's field of the tools or the answer's format, none when the grammar
    held both), else 500 ``generation_failed``."""
    if isinstance(exc, GrammarError):
        log.error("generation %s: %s; the grammar engine reports:\n%s", turn_id, exc, exc.details)
        fields = [req.params.rename(name)[0] for name in req.reply.constrained_fields]
        return APIError(
            422,
            f"the reply could not be kept to the requested {' or '.join(fields)}: {exc} (details in the server "
            "log); the request may be retried",
            fields[0] if len(fields) == 1 else None,
            "reply_format_failed",
        )
    log.exception("generation %s failed", turn_id, exc_info=exc)
    return APIError(500, f"the generation failed: {exc}", type="server_error", code="generation_failed")


async def _until_disconnected(request: Request) -> None:
    """Returns when the client has gone (call after the body has been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


@contextlib.contextmanager
def preparation_errors(req: ChatRequest):
    """Turn what preparing ``req`` raises into its :class:`APIError` (fields named as ``req``'s API names them):
    413 for an image or video over the limits, 400 for the rest (see :meth:`ConversationCore.prepare`)."""
    try:
        yield
    except ImageTooLarge as exc:
        video = ".video" in (exc.param or "")
        limits = (
            "--max-video-bytes, --max-video-seconds, --max-video-frames, --max-video-frame-pixels"
            if video
            else "--max-image-bytes, --max-image-pixels"
        )
        error = req.error(exc, 413, "video_too_large" if video else "image_too_large")
        error.message = f"{error.message} ({limits})"
        raise error from None
    except ChatInputError as exc:
        raise req.error(exc) from None
    except PromptTooLongError as exc:
        raise req.error(ChatInputError(f"{exc} (the export's --max-seq-len)", "messages")) from None
    except ValueError as exc:  # invalid Unicode, template errors
        param = "chat_template_kwargs" if isinstance(exc, TemplateKwargsError) else "messages"
        raise req.error(ChatInputError(str(exc), param)) from None


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


class ConversationCore:
    """The state behind every generation route: the pipeline, its scheduler, kept states, options, sampling
    defaults and metrics."""

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

    # ---- observers ----------------------------------------------------------------------------------------------
    def _step(self, rows: int) -> None:  # worker thread, once per decode step
        self.metrics.decode_step(rows)

    def _record(self, generation: ScheduledGeneration) -> None:  # event loop, once per generation
        result = generation.stream.result
        start = generation.arrived
        timings = result.generation.timings
        self.metrics.generation(
            generation.route,
            generation.outcome,
            result.prompt_tokens,
            result.completion_tokens,
            timings.tokens_per_s,
            None if generation.first_text_at is None else generation.first_text_at - start,
            (generation.ended_at or time.monotonic()) - start,
            timings.drafted,
            timings.accepted,
        )

    # ---- requests -----------------------------------------------------------------------------------------------
    def authorize(self, request: Request) -> None:
        authorize(request, self.options.api_key)

    async def read_json(self, request: Request):
        """The request's JSON body (NaN and Infinity refused: they are not JSON).

        Raises:
            APIError: 413 over ``--max-body-bytes``; 400 for an empty body or one that is not JSON.
        """
        body = await read_body(request, self.options.max_body_bytes)
        if not body:
            raise bad_request("the request body is empty; send a JSON object")
        try:
            if len(body) > MIB:
                return await asyncio.to_thread(json.loads, body, parse_constant=_reject_constant)
            return json.loads(body, parse_constant=_reject_constant)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise bad_request(f"the request body is not valid JSON: {str(exc)[:200]}") from None

    def prepare(self, req: ChatRequest) -> PreparedPrompt:  # preparation thread
        """``req``'s prompt (template, images, videos, tools; the grammar compiled to check it).

        Raises:
            APIError: 400 for bad messages, images, videos, template variables, a schema the grammar cannot take
                or a prompt over the capacity (naming both numbers); 413 for an image or video over the limits.
        """
        with preparation_errors(req):
            return self._prepare(req)

    def _prepare(self, req: ChatRequest) -> PreparedPrompt:
        self.pipeline.grammars.check(req.reply)
        return self.pipeline.prepare_chat(
            req.messages,
            req.chat_template_kwargs,
            self.image_policy,
            req.reply,
            fps=req.fps,
            max_video_tokens=req.max_video_tokens,
        )

    def room(self, prepared: PreparedPrompt, asked: int | None) -> int:
        """The reply's token limit: the smallest of ``asked``, ``--max-tokens`` and what the capacity leaves."""
        limits = [self.pipeline.token_room(prepared), asked, self.options.max_tokens]
        return min(limit for limit in limits if limit is not None)

    async def count_tokens(self, req: ChatRequest) -> int:
        """The prompt tokens of ``req`` (prepared as for a reply, nothing generated); a prompt over the capacity
        is counted too.

        Raises:
            APIError: see :meth:`prepare`.
        """

        def count() -> int:
            with preparation_errors(req):
                try:
                    return self._prepare(req).prompt_len
                except PromptTooLongError as exc:
                    if exc.prompt_len is None:
                        raise
                    return exc.prompt_len

        return await self.scheduler.prepare(count)

    async def counted(self, route: str, answer) -> Response:
        """``await answer()``, counted in the metrics under ``route`` by its HTTP status (an error by its own)."""
        try:
            response = await answer()
        except APIError as exc:
            self.metrics.request(route, exc.status)
            raise
        except Exception:  # answered 500 by the application's handler (a shutdown's cancellation is not counted)
            self.metrics.request(route, 500)
            raise
        self.metrics.request(route, response.status_code)
        return response

    async def answer(self, request: Request, api: API) -> Response:
        """Answer a generation request of ``api`` (see the module docstring), counted in the metrics."""
        return await self.counted(api.route, lambda: self._answer(request, api, time.monotonic()))

    async def _answer(self, request: Request, api: API, arrived: float) -> Response:
        self.authorize(request)
        parsed = api.parse(await self.read_json(request), request)
        turn = await self.start(request, parsed.chat, api.route, arrived)
        if turn is None:
            return Response(status_code=499)  # nobody is listening
        if parsed.chat.stream:
            turn.streamed()
            return EventStream(api.events(turn, parsed), turn.cancel)
        try:
            deltas = await turn.whole()
            if deltas is None:
                return Response(status_code=499)  # the finally below cancels the generation
            return JSONBody(api.body(turn, deltas, parsed))
        finally:
            turn.cancel()  # no-op once it has ended

    async def start(self, request: Request, req: ChatRequest, route: str, arrived: float) -> Turn | None:
        """Prepare ``req`` and start its generation in a slot (waiting in the queue while all are taken); None
        when the client left before its turn.

        Raises:
            APIError: 429 when the queue is full; see :meth:`prepare`.
        """
        scheduler = self.scheduler
        scheduler.refuse_if_full()  # cheap refusal before the costly preparation
        prepared = await scheduler.prepare(self.prepare, req)
        max_tokens = self.room(prepared, req.max_tokens)
        gone = asyncio.ensure_future(_until_disconnected(request))
        try:
            if not await scheduler.admit(gone):
                gone.cancel()
                return None
            try:
                generation = await scheduler.start(
                    functools.partial(self.pipeline.stream_chat_prepared, reasoning_budget=req.reasoning_budget),
                    prepared,
                    max_tokens,
                    req.sampling,
                    req.stop,
                    req.reply,
                    self.state_cache,
                    arrived=arrived,
                    route=route,
                )
            except ValueError as exc:
                raise bad_request(str(exc)) from None
        except BaseException:
            gone.cancel()
            raise
        return Turn(generation, req, prepared.prompt_len, max_tokens, gone)

    # ---- the server's facts -------------------------------------------------------------------------------------
    def model_card(self) -> dict:
        """The served model as ``/v1/models`` lists it (``max_model_len``: the capacity, as vLLM names it;
        ``max_tokens``: the server's reply limit, ``--max-tokens``, null when none)."""
        return {
            "id": self.options.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "qwen35-onnx",
            "max_model_len": self.pipeline.contract.capacity,
            "max_tokens": self.options.max_tokens,
        }

    def health(self) -> dict:
        cache = self.state_cache.stats() if self.state_cache is not None else None
        return {
            "status": "ok",
            "model": self.options.model_name,
            "capacity": self.pipeline.contract.capacity,
            "max_tokens": self.options.max_tokens,
            **self.scheduler.state(),
            "state_cache": cache,
        }
