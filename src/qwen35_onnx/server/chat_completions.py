"""``POST /v1/chat/completions``: the OpenAI Chat Completions API over the conversation core (no HTTP here):
a body checked into a :class:`~.request.ChatRequest`, the core's deltas written as ``chat.completion.chunk``
events or one ``chat.completion``.

Request fields: the OpenAI Chat Completions body (``messages``, ``stream``, ``max_tokens`` /
``max_completion_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop``,
``stream_options.include_usage``, ``n`` = 1, ``tools``, ``tool_choice``, ``parallel_tool_calls``,
``response_format``) plus extensions vLLM also takes: ``top_k``, ``chat_template_kwargs``
(e.g. ``{"enable_thinking": false}``) and ``mm_processor_kwargs.fps`` (frames sampled per second of
video; also as ``fps``), and ``max_video_tokens`` (the video-token limit of each video). Replies carry
``reasoning_content`` next to ``content`` (vLLM's field) and ``tool_calls`` (streamed whole, one delta
per call). Features this server does not have are refused with 400, never ignored.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ..conversation.reasoning import ChatDelta
from ..conversation.videos import MAX_FPS
from ..runtime.sampling import SamplingConfig
from .errors import APIError, bad_request
from .http import sse
from .request import ChatRequest, is_int, is_number, optional, parse_sampling, parse_stop, reply_format, require_object

__all__ = [
    "SSE_DONE",
    "ChatCompletions",
    "CompletionRequest",
    "chunk",
    "chunk_choice",
    "completion",
    "delta_dict",
    "message_dict",
    "parse_chat_request",
    "usage",
    "usage_of",
]

ROUTE = "/v1/chat/completions"
SSE_DONE = "data: [DONE]\n\n"
"""The event that ends a stream."""


@dataclass
class CompletionRequest:
    """A checked ``/v1/chat/completions`` body: the core's request and ``stream_options.include_usage``."""

    chat: ChatRequest
    include_usage: bool = False


def _fps_ok(value) -> bool:
    """Frames per second in ``(0, MAX_FPS]`` (compared before anything converts it: a huge JSON integer stays an
    int)."""
    return is_number(value) and 0 < value <= MAX_FPS


def parse_chat_request(body, defaults: SamplingConfig | None = None, reserved_kwargs=frozenset()) -> CompletionRequest:
    """Check the types and values of a ``/v1/chat/completions`` body (``messages`` themselves are
    checked by ``Pipeline.prepare_chat``). ``defaults``: the export's sampling defaults;
    ``reserved_kwargs``: names ``chat_template_kwargs`` may not set
    (``Preprocessor.reserved_template_kwargs``), refused here so the 400 comes before any queueing.

    Raises:
        APIError: 400 naming the field and what it must be.
    """
    body = require_object(body)
    if "messages" not in body:
        raise bad_request("messages is required", "messages")
    optional(body, "model", lambda v: isinstance(v, str), "a string")
    stream = bool(optional(body, "stream", lambda v: isinstance(v, bool), "true or false"))
    stream_options = optional(body, "stream_options", lambda v: isinstance(v, dict), "an object")
    include_usage = False
    if stream_options:
        include_usage = bool(
            optional(
                stream_options,
                "include_usage",
                lambda v: isinstance(v, bool),
                "true or false",
                "stream_options.include_usage",
            )
        )
    n = optional(body, "n", is_int, "an integer")
    if n is not None and n != 1:
        raise bad_request(f"n must be 1 (one choice per request), got {n}", "n")
    max_tokens = None
    for name in ("max_tokens", "max_completion_tokens"):  # the newer name wins, as in vLLM
        value = optional(body, name, lambda v: is_int(v) and v >= 1, "an integer >= 1")
        if value is not None:
            max_tokens = int(value)
    sampling = parse_sampling(body, defaults or SamplingConfig())
    stop = parse_stop(body.get("stop"), "stop")

    kwargs = optional(body, "chat_template_kwargs", lambda v: isinstance(v, dict), "an object")
    if kwargs:
        reserved = sorted(set(reserved_kwargs) & set(kwargs))
        if reserved:
            raise bad_request(f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs")

    fps = optional(body, "fps", _fps_ok, f"a number in (0, {MAX_FPS:g}] (frames per second)")
    mm_kwargs = optional(body, "mm_processor_kwargs", lambda v: isinstance(v, dict), "an object")
    if mm_kwargs:
        unknown = sorted(set(mm_kwargs) - {"fps"})
        if unknown:
            raise bad_request(f"mm_processor_kwargs may set fps only, got {', '.join(unknown)}", "mm_processor_kwargs")
        value = optional(mm_kwargs, "fps", _fps_ok, f"a number in (0, {MAX_FPS:g}]", "mm_processor_kwargs.fps")
        fps = value if value is not None else fps
    max_video_tokens = optional(body, "max_video_tokens", lambda v: is_int(v) and v >= 1, "an integer >= 1")

    # Features this server does not have: refused rather than silently ignored.
    reply = reply_format(
        body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls"), body.get("response_format")
    )
    for name, off in (
        ("functions", lambda v: not v),
        ("logprobs", lambda v: not v),
        ("logit_bias", lambda v: not v),
        ("presence_penalty", lambda v: v == 0),
        ("frequency_penalty", lambda v: v == 0),
    ):
        value = body.get(name)
        if value is not None and not off(value):
            raise bad_request(f"{name} is not supported by this server", name)

    chat = ChatRequest(
        messages=body["messages"],
        stream=stream,
        max_tokens=max_tokens,
        sampling=sampling,
        stop=stop,
        chat_template_kwargs=kwargs or None,
        reply=reply,
        fps=None if fps is None else float(fps),
        max_video_tokens=max_video_tokens,
    )
    return CompletionRequest(chat, include_usage)


# ---- replies -----------------------------------------------------------------------------------
def delta_dict(delta: ChatDelta, first_call_index: int = 0) -> dict:
    """A chunk's ``delta`` for a :class:`~qwen35_onnx.conversation.reasoning.ChatDelta`; its tool
    calls are numbered from ``first_call_index`` (the calls of the reply's earlier deltas)."""
    out = {}
    if delta.reasoning_content:
        out["reasoning_content"] = delta.reasoning_content
    if delta.content:
        out["content"] = delta.content
    if delta.tool_calls:
        out["tool_calls"] = [
            {"index": first_call_index + i, **call.to_openai()} for i, call in enumerate(delta.tool_calls)
        ]
    return out


def message_dict(content: str, reasoning_content: str | None, tool_calls: list) -> dict:
    """A whole reply's ``message``: with calls, blank ``content`` is null (as OpenAI sends it)."""
    message = {"role": "assistant", "content": content, "reasoning_content": reasoning_content}
    if tool_calls:
        message["content"] = content if content.strip() else None
        message["tool_calls"] = [call.to_openai() for call in tool_calls]
    return message


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, drafted: int = 0, accepted: int = 0
) -> dict:
    """The ``usage`` object (tokens; ``prompt_tokens_details.cached_tokens``: prompt tokens taken from a
    kept state, as OpenAI reports its prompt caching; with speculative decoding (``drafted`` > 0)
    ``completion_tokens_details.accepted_prediction_tokens`` / ``rejected_prediction_tokens``: the draft tokens
    kept and dropped, the fields OpenAI reports predicted outputs with)."""
    body = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    if drafted:
        body["completion_tokens_details"] = {
            "accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": drafted - accepted,
        }
    return body


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


def chunk(completion_id: str, created: int, model: str, choices: list, usage=None, include_usage: bool = False) -> dict:
    """A ``chat.completion.chunk`` (``usage`` present, possibly null, when the client asked for it)."""
    body = {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": choices,
    }
    if include_usage:
        body["usage"] = usage
    return body


def chunk_choice(delta: dict, finish_reason: str | None = None) -> list:
    """The ``choices`` of a chunk: one choice with ``delta``."""
    return [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]


def completion(
    completion_id: str, created: int, model: str, message: dict, finish_reason: str | None, usage: dict
) -> dict:
    """A whole ``chat.completion``."""
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}],
        "usage": usage,
    }


class ChatCompletions:
    """The chat completions API of a server (see the module docstring): ``model`` is the served model's id,
    ``defaults`` the export's sampling, ``reserved_kwargs`` the template variables requests may not set."""

    route = ROUTE

    def __init__(self, model: str, defaults: SamplingConfig, reserved_kwargs=frozenset()):
        self.model, self.defaults, self.reserved_kwargs = model, defaults, reserved_kwargs

    def parse(self, body, request=None) -> CompletionRequest:
        return parse_chat_request(body, self.defaults, self.reserved_kwargs)

    async def events(self, turn, req: CompletionRequest) -> AsyncIterator[str]:
        """``chat.completion.chunk`` events: the role, one per delta, the finish reason, the usage when asked
        for, ``[DONE]``; a failure is an error event then ``[DONE]``."""
        completion_id, created, model = f"chatcmpl-{turn.id}", int(time.time()), self.model
        usage_on = req.include_usage

        def event(choices: list, body_usage=None) -> str:
            return sse(chunk(completion_id, created, model, choices, body_usage, include_usage=usage_on))

        yield event(chunk_choice({"role": "assistant", "content": ""}))
        calls = 0
        try:
            async for delta in turn.deltas():
                if delta is None:
                    yield ": keep-alive\n\n"
                    continue
                yield event(chunk_choice(delta_dict(delta, calls)))
                calls += len(delta.tool_calls)
        except APIError as error:
            yield sse(error.body())
            yield SSE_DONE
            return
        result = turn.result
        yield event(chunk_choice({}, result.finish_reason))
        if usage_on:
            yield event([], usage_of(result))
        yield SSE_DONE

    def body(self, turn, deltas: list[ChatDelta], req: CompletionRequest) -> dict:
        """A whole ``chat.completion``."""
        result = turn.result
        message = message_dict(result.content, result.reasoning_content, result.tool_calls)
        return completion(
            f"chatcmpl-{turn.id}", int(time.time()), self.model, message, result.finish_reason, usage_of(result)
        )
