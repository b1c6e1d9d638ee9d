"""The one request the conversation core (:mod:`.core`) takes, whichever API it came through, and the checks
the three APIs' parsers share (no HTTP).

Every API translates its body into a :class:`ChatRequest`: OpenAI-style chat ``messages`` (the form
:func:`~qwen35_onnx.conversation.messages.normalize_messages` reads), a
:class:`~qwen35_onnx.conversation.tools.ReplyFormat` (tools, tool choice, parallel calls, a JSON schema), the
template switches (``enable_thinking``), sampling, stop strings and the reply's token limit. The core prepares it
with the pipeline (template, images, grammar, reasoning split, tool-call parsing, kept states) and runs it; the API
writes what comes back in its own shape. Errors found while preparing name fields of the translated messages
(``messages[2].content[0]``): :class:`ParamNames` renames them to the API's own fields (``input[3].content[0]``).
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import threading
from dataclasses import dataclass, field

from ..conversation.messages import ChatInputError
from ..conversation.tools import ReplyFormat, parse_reply_format
from ..runtime.sampling import SamplingConfig
from .errors import APIError, bad_request

__all__ = [
    "MAX_STOP_STRINGS",
    "ChatRequest",
    "ParamNames",
    "is_int",
    "is_number",
    "optional",
    "parse_sampling",
    "parse_stop",
    "reply_format",
    "require_object",
    "warn_once",
]

MAX_STOP_STRINGS = 16

log = logging.getLogger(__name__)
_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_once(key: str, message: str, *args) -> None:
    """Log ``message`` as a warning the first time ``key`` is seen in this process."""
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    log.warning(message, *args)


class ParamNames:
    """How the fields of a translated request (chat form: ``messages[i]...``, ``tools[k]...``,
    ``response_format``) are called in the API the request came through: prefixes, the longest that matches
    wins."""

    def __init__(self, names: dict[str, str] | None = None):
        self._names: dict[str, str] = dict(names or {})

    def add(self, chat: str, api: str) -> None:
        """Name the chat-form field ``chat`` (and the fields below it) ``api``."""
        self._names[chat] = api

    def _prefix(self, param: str) -> str | None:
        best = None
        for chat in self._names:
            if param == chat or (param.startswith(chat) and param[len(chat)] in ".["):
                if best is None or len(chat) > len(best):
                    best = chat
        return best

    def rename(self, param: str | None, message: str = "") -> tuple[str | None, str]:
        """``(param, message)`` with the chat-form field renamed (in the message too); unchanged when no prefix
        matches."""
        if param is None:
            return None, message
        prefix = self._prefix(param)
        if prefix is None:
            return param, message
        api = self._names[prefix]
        return api + param[len(prefix) :], message.replace(prefix, api)


@dataclass
class ChatRequest:
    """A request as the conversation core takes it (see the module docstring).

    Attributes:
        messages: OpenAI-style chat messages (checked by ``Pipeline.prepare_chat``).
        stream: answer with server-sent events as tokens come.
        max_tokens: the reply's token limit asked for (None: the capacity's; the server's ``--max-tokens`` and
            the capacity bound it further).
        sampling: temperature, top-k, top-p and seed.
        stop: strings that end the reply (not included in it).
        chat_template_kwargs: template variables, e.g. ``{"enable_thinking": False}``.
        reply: tools, tool choice, parallel calls and the answer's JSON schema.
        reasoning_budget: most reasoning tokens before ``</think>`` is forced (None: no limit of its own).
        fps, max_video_tokens: video sampling (chat completions' extensions).
        params: the API's names of the translated fields (errors name them).
    """

    messages: list
    stream: bool = False
    max_tokens: int | None = None
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop: tuple[str, ...] = ()
    chat_template_kwargs: dict | None = None
    reply: ReplyFormat = field(default_factory=ReplyFormat)
    reasoning_budget: int | None = None
    fps: float | None = None
    max_video_tokens: int | None = None
    params: ParamNames = field(default_factory=ParamNames, repr=False)

    def error(self, exc: ChatInputError | ValueError, status: int = 400, code: str | None = None) -> APIError:
        """The :class:`APIError` of a preparation error ``exc`` (its ``param`` renamed to the API's field)."""
        param, message = self.params.rename(getattr(exc, "param", None), str(exc))
        return APIError(status, message, param, code or ("invalid_value" if param else None))


def is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def require_object(body) -> dict:
    """``body`` when it is a JSON object; else a 400."""
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def optional(body: dict, name: str, check, what: str, param: str | None = None):
    """``body[name]`` (None when absent or null), checked by ``check``; a 400 naming ``param`` (default
    ``name``) saying it must be ``what`` otherwise."""
    value = body.get(name)
    if value is not None and not check(value):
        raise bad_request(f"{param or name} must be {what}, got {json.dumps(value)[:80]}", param or name)
    return value


def parse_sampling(body: dict, defaults: SamplingConfig, seed_field: str | None = "seed") -> SamplingConfig:
    """``temperature``, ``top_p``, ``top_k`` and (``seed_field``, None: none) ``seed`` of ``body`` over
    ``defaults`` (the export's sampling).

    Raises:
        APIError: 400 naming the field and its range.
    """
    temperature = optional(
        body, "temperature", lambda v: is_number(v) and math.isfinite(v) and v >= 0, "a number >= 0 (0 = greedy)"
    )
    top_p = optional(body, "top_p", lambda v: is_number(v) and 0 < v <= 1, "a number in (0, 1]")
    top_k = optional(body, "top_k", lambda v: is_int(v) and v >= -1, "an integer >= -1 (0 or -1 = off)")
    seed = optional(body, seed_field, lambda v: is_int(v) and v >= 0, "an integer >= 0") if seed_field else None
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
    return sampling


def parse_stop(value, name: str) -> tuple[str, ...]:
    """Stop strings: a string or a list of at most :data:`MAX_STOP_STRINGS` non-empty strings (None: none).

    Raises:
        APIError: 400 naming ``name``.
    """
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise bad_request(f"{name} must be a string or a list of strings, got {type(value).__name__}", name)
    if len(value) > MAX_STOP_STRINGS:
        raise bad_request(f"{name} holds {len(value)} strings, more than {MAX_STOP_STRINGS}", name)
    if any(not s for s in value):
        raise bad_request(f"{name} strings must be non-empty, got ''", name)
    return tuple(value)


def reply_format(
    tools=None, tool_choice=None, parallel_tool_calls=None, response_format=None, params: ParamNames | None = None
) -> ReplyFormat:
    """:func:`~qwen35_onnx.conversation.tools.parse_reply_format` of chat-form fields, its errors a 400 naming
    the API's field (``params``)."""
    try:
        return parse_reply_format(tools, tool_choice, parallel_tool_calls, response_format)
    except ChatInputError as exc:
        param, message = (params or ParamNames()).rename(exc.param, str(exc))
        raise bad_request(message, param) from None
