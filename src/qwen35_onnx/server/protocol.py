"""The OpenAI Chat Completions protocol, without HTTP: a request body checked into a
:class:`ChatRequest`, errors as OpenAI error bodies (:class:`APIError`), and the reply bodies
(whole completions and ``chat.completion.chunk`` server-sent events).

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

import json
import math
import numbers
from dataclasses import dataclass, field

from ..conversation.messages import ChatInputError
from ..conversation.reasoning import ChatDelta
from ..conversation.tools import ReplyFormat, parse_reply_format
from ..conversation.videos import MAX_FPS
from ..runtime.sampling import SamplingConfig

__all__ = [
    "APIError",
    "ChatRequest",
    "bad_request",
    "chunk",
    "chunk_choice",
    "completion",
    "delta_dict",
    "message_dict",
    "parse_chat_request",
    "sse",
    "usage",
]

MAX_STOP_STRINGS = 16


class APIError(Exception):
    """An error answered as an OpenAI error body with HTTP ``status`` (and a ``Retry-After`` header of
    ``retry_after`` seconds when given)."""

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
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    """A 400 ``invalid_request_error`` naming ``param`` (the field) when given."""
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
    reply: ReplyFormat = field(default_factory=ReplyFormat)
    fps: float | None = None
    max_video_tokens: int | None = None


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _fps_ok(value) -> bool:
    """Frames per second in ``(0, MAX_FPS]`` (compared before anything converts it: a huge JSON integer stays an
    int)."""
    return _is_number(value) and 0 < value <= MAX_FPS


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
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    if "messages" not in body:
        raise bad_request("messages is required", "messages")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request(f"model must be a string, got {type(model).__name__}", "model")

    def optional(name, check, what):
        value = body.get(name)
        if value is not None and not check(value):
            raise bad_request(f"{name} must be {what}, got {json.dumps(value)[:80]}", name)
        return value

    stream = bool(optional("stream", lambda v: isinstance(v, bool), "true or false"))
    stream_options = optional("stream_options", lambda v: isinstance(v, dict), "an object")
    include_usage = False
    if stream_options:
        include_usage = stream_options.get("include_usage")
        if include_usage is not None and not isinstance(include_usage, bool):
            raise bad_request("stream_options.include_usage must be true or false", "stream_options.include_usage")
        include_usage = bool(include_usage)

    n = optional("n", _is_int, "an integer")
    if n is not None and n != 1:
        raise bad_request(f"n must be 1 (one choice per request), got {n}", "n")
    max_tokens = None
    for name in ("max_tokens", "max_completion_tokens"):  # the newer name wins, as in vLLM
        value = optional(name, lambda v: _is_int(v) and v >= 1, "an integer >= 1")
        if value is not None:
            max_tokens = int(value)

    temperature = optional(
        "temperature", lambda v: _is_number(v) and math.isfinite(v) and v >= 0, "a number >= 0 (0 = greedy)"
    )
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
        raise bad_request(str(exc), str(exc).split(" ", 1)[0]) from None

    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stop = tuple(stop)
    else:
        raise bad_request(f"stop must be a string or a list of strings, got {type(stop).__name__}", "stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise bad_request(f"stop holds {len(stop)} strings, more than {MAX_STOP_STRINGS}", "stop")
    if any(not s for s in stop):
        raise bad_request("stop strings must be non-empty, got ''", "stop")

    kwargs = optional("chat_template_kwargs", lambda v: isinstance(v, dict), "an object")
    if kwargs:
        reserved = sorted(set(reserved_kwargs) & set(kwargs))
        if reserved:
            raise bad_request(f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs")

    fps = optional("fps", _fps_ok, f"a number in (0, {MAX_FPS:g}] (frames per second)")
    mm_kwargs = optional("mm_processor_kwargs", lambda v: isinstance(v, dict), "an object")
    if mm_kwargs:
        unknown = sorted(set(mm_kwargs) - {"fps"})
        if unknown:
            raise bad_request(f"mm_processor_kwargs may set fps only, got {', '.join(unknown)}", "mm_processor_kwargs")
        value = mm_kwargs.get("fps")
        if value is not None and not _fps_ok(value):
            raise bad_request(
                f"mm_processor_kwargs.fps must be a number in (0, {MAX_FPS:g}], got {json.dumps(value)[:80]}",
                "mm_processor_kwargs.fps",
            )
        fps = value if value is not None else fps
    max_video_tokens = optional("max_video_tokens", lambda v: _is_int(v) and v >= 1, "an integer >= 1")

    # Features this server does not have: refused rather than silently ignored.
    try:
        reply = parse_reply_format(
            body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls"), body.get("response_format")
        )
    except ChatInputError as exc:
        raise bad_request(str(exc), exc.param) from None

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

    return ChatRequest(
        messages=body["messages"],
        stream=stream,
        include_usage=include_usage,
        max_tokens=max_tokens,
        sampling=sampling,
        stop=stop,
        chat_template_kwargs=kwargs or None,
        reply=reply,
        fps=None if fps is None else float(fps),
        max_video_tokens=max_video_tokens,
    )


# ---- replies -----------------------------------------------------------------------------------
def sse(payload) -> str:
    """One server-sent event carrying ``payload`` as compact JSON."""
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"
"""The event that ends a stream."""


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
